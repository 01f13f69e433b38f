"""Corpora of models as data: KernelBench level 2 (kernelbench_l2) and models written the way outside code writes them (outside)."""
