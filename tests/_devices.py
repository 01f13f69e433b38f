"""The device parameter of tests that run on the CPU and, marked ``gpu``, on the GPU."""
import pytest
import torch

from cupyfuse.interop import cupy_available

GPU = pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                       reason="needs a CUDA GPU visible to both torch and CuPy")])
DEVICES = ["cpu", GPU]
