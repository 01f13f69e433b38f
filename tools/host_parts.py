"""Where the host time of a prepared call goes: each piece timed alone in a tight loop
(us per call, median of 7 rounds). PYTHONPATH=. python tools/host_parts.py"""

import cupy
import torch

import cupyfuse
from cupyfuse import fused, gemm
from cupyfuse import prepared as prep
from _hosttime import us


def tail(h):
    return torch.sigmoid(h).sum(dim=1, keepdim=True)


x = torch.rand(32, 512, device="cuda")
w = torch.rand(512, 512, device="cuda")
b = torch.rand(512, device="cuda")
xc, wc, bc = cupy.asarray(x), cupy.asarray(w), cupy.asarray(b)
d = torch.device("cuda", 0)
for _ in range(3):
    cupyfuse.fused_linear(x, w, b, tail)
    cupyfuse.fused_linear(xc, wc, bc, tail)
key = next(k for k, v in fused._fast_fn.items() if k[0] is tail and not k[4] and v)
pr, fixed = fused._fast_fn[key]
stream = prep.torch_stream(0)
parts = {
    "torch.empty((32,1))": lambda: torch.empty((32, 1), device=d),
    "cupy.empty((32,1))": lambda: cupy.empty((32, 1), dtype=cupy.float32),
    "raw stream": lambda: prep.torch_stream(0),
    "current device": lambda: prep.current_device(),
    "_meta torch": lambda: fused._meta(x),
    "_meta cupy": lambda: fused._meta(xc),
    "dispatch_key": gemm.dispatch_key,
    "prepared call (alloc + 2 launches)": lambda: pr([x.data_ptr()], [w.data_ptr(), b.data_ptr()],
                                                      stream, False),
    "fused_linear torch (all)": lambda: cupyfuse.fused_linear(x, w, b, tail),
    "fused_linear cupy (all)": lambda: cupyfuse.fused_linear(xc, wc, bc, tail),
    "empty nn.Module call": (lambda m: (lambda: m(x)))(torch.nn.Identity()),
}
for k, f in parts.items():
    print(f"  {k:40s} {us(f):7.2f}", flush=True)
