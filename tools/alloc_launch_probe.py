"""Host cost of the pieces a prepared call cannot skip: allocating the result (torch.empty
forms) and launching a kernel (CuPy's driver.launchKernel against a direct ctypes call of
cuLaunchKernel), us per call in a tight loop (median of 7 rounds).
PYTHONPATH=.:tools python tools/alloc_launch_probe.py"""
import ctypes

import cupy
import torch

from cupyfuse import prepared as prep
from cupyfuse.runtime import get_function
from _hosttime import us

d = torch.device("cuda", 0)
x = torch.rand(32, 512, device=d)
empty = torch.empty
parts = {
    "torch.empty((32,1), device=d)": lambda: empty((32, 1), device=d),
    "torch.empty(32, 1, device=d)": lambda: empty(32, 1, device=d),
    "x.new_empty((32,1))": lambda: x.new_empty((32, 1)),
    "torch.empty(..., dtype, device)": lambda: empty((32, 1), dtype=torch.float32, device=d),
    "cupy.empty((32,1))": lambda: cupy.empty((32, 1), dtype=cupy.float32),
    "torch.empty_like(t)": (lambda t: lambda: torch.empty_like(t))(torch.empty(32, 1, device=d)),
    "t.new_empty(32, 1)": (lambda t: lambda: t.new_empty(32, 1))(torch.empty(32, 1, device=d)),
    "aten.empty.memory_format": lambda: torch.ops.aten.empty.memory_format([32, 1], device=d),
}
for k, f in parts.items():
    print(f"  {k:40s} {us(f):7.2f}", flush=True)

# a trivial kernel: the launch alone
src = r'''extern "C" __global__ void nop(float* p, int n) { if (n < 0) p[0] = 1.f; }'''
mod = cupy.RawModule(code=src)
fn = mod.get_function("nop")
fptr = fn.kernel.ptr
stream = prep.torch_stream(0)
args = (ctypes.c_void_p * 2)()
a0, a1 = ctypes.c_uint64(x.data_ptr()), ctypes.c_int(5)
args[0], args[1] = ctypes.addressof(a0), ctypes.addressof(a1)
from cupy.cuda import driver
launch = driver.launchKernel
aptr = ctypes.addressof(args)
print(f"  {'cupy driver.launchKernel':40s} "
      f"{us(lambda: launch(fptr, 1, 1, 1, 32, 1, 1, 0, stream, aptr, 0)):7.2f}", flush=True)
libcuda = ctypes.CDLL("libcuda.so.1")
cu = libcuda.cuLaunchKernel
cu.restype = ctypes.c_int
cu.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
               ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
               ctypes.c_void_p]
print(f"  {'ctypes cuLaunchKernel':40s} "
      f"{us(lambda: cu(fptr, 1, 1, 1, 32, 1, 1, 0, stream, aptr, None)):7.2f}", flush=True)
print(f"  {'cupy RawKernel call':40s} "
      f"{us(lambda: fn((1,), (32,), (x.data_ptr(), 5))):7.2f}", flush=True)
print(f"  {'empty python call':40s} {us(lambda: None):7.2f}", flush=True)
