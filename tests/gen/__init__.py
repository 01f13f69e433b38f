"""Generators of drawn models and tails for the property tests."""
