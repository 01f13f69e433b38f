"""Emulators: generated CUDA run as C++ on the CPU, the GPU path and prepared launches on CPU tensors."""
