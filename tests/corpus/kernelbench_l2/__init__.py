"""KernelBench level-2 Linear-family problems, rewritten as standalone model files."""
