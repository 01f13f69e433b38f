"""Generic path probe: GPU time per kernel of fused_class models (torch.profiler), host time
per call of the generic path at a launch-bound size (batch 32, 512 x 512) in every calling
mode, and a cProfile of one mode.
Usage: PYTHONPATH=. python tools/generic_probe.py [--kernels 14 18 98 55] [--host] [--cprofile]"""
import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import cupyfuse
from tests.kernelbench.index import load, path_of

ap = argparse.ArgumentParser()
ap.add_argument("--kernels", nargs="*", type=int, default=[])
ap.add_argument("--host", action="store_true")
ap.add_argument("--cprofile", action="store_true")
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--features", type=int, default=512)
args = ap.parse_args()

for num in args.kernels:
    mod = load(path_of(num))
    torch.manual_seed(0)
    New = cupyfuse.fused_class(mod.Model)
    m = New(*mod.get_init_inputs()).cuda()
    xs = [t.cuda() for t in mod.get_inputs()]
    for _ in range(3):
        m(*xs)
    torch.cuda.synchronize()
    reps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            m(*xs)
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rows[e.name] = rows.get(e.name, 0.0) + e.device_time / reps
    print(f"== KB {num}: GPU time per call by kernel (us)")
    for name, t in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {t:9.1f}  {name[:90]}")
    print(f"  {sum(rows.values()):9.1f}  total", flush=True)
    del m, xs
    torch.cuda.empty_cache()


def host_us(fn, n=300):
    """(host us per call: the loop's time before the final sync; wall us per call)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


class Lin(torch.nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.linear = torch.nn.Linear(k, n)

    def forward(self, x):
        return torch.sigmoid(self.linear(x)).sum(dim=1, keepdim=True)


def tail(h):
    return torch.sigmoid(h).sum(dim=1, keepdim=True)


if args.host or args.cprofile:
    B, F = args.batch, args.features
    torch.manual_seed(0)
    orig = Lin(F, F).cuda()
    fm = cupyfuse.from_model(orig)
    FC = cupyfuse.fused_class(Lin)
    torch.manual_seed(0)
    fc = FC(F, F).cuda()
    x = torch.rand(B, F, device="cuda")
    w, b = orig.linear.weight.detach(), orig.linear.bias.detach()
    import cupy
    xc, wc, bc = cupy.asarray(x), cupy.asarray(w), cupy.asarray(b)
    pw = cupyfuse.prepare_weight(wc)
    modes = {
        "eager_grad": lambda: orig(x),
        "from_model_grad": lambda: fm(x),
        "fused_class_grad": lambda: fc(x),
        "fn_torch": lambda: cupyfuse.fused_linear(x, w, b, tail),
        "fn_cupy": lambda: cupyfuse.fused_linear(xc, wc, bc, tail),
        "fn_cupy_prepared": lambda: cupyfuse.fused_linear(xc, pw, bc, tail),
        "cupy_math": lambda: (1 / (1 + cupy.exp(-(xc @ wc.T + bc)))).sum(axis=1, keepdims=True),
        "named_fn_torch": lambda: cupyfuse.matmul_sigmoid_sum(x, w, b),
        "named_fn_cupy": lambda: cupyfuse.matmul_sigmoid_sum(xc, wc, bc),
    }
    from cupyfuse import models
    from cupyfuse import nn as cnn
    torch.manual_seed(0)
    o56 = models.MatmulSigmoidSum(F, F).cuda()
    n56 = cnn.from_model(o56)
    modes["named_module_grad"] = lambda: n56(x)
    modes["eager56_grad"] = lambda: o56(x)
    if args.host:
        print(f"== per call, batch {B}, {F} x {F}: host us (before the final sync), wall us")
        for k, f in modes.items():
            print("  %-20s %8.1f %8.1f" % ((k,) + host_us(f)), flush=True)
        with torch.no_grad():
            for k in ("eager_grad", "from_model_grad", "fused_class_grad", "named_module_grad",
                      "eager56_grad"):
                print("  %-20s %8.1f %8.1f" % ((k.replace('grad', 'nograd'),) + host_us(modes[k])),
                      flush=True)
    if args.cprofile:
        for k in ("fused_class_grad", "fn_cupy_prepared"):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(300):
                modes[k]()
            pr.disable()
            print(f"== cProfile {k} (300 calls)")
            pstats.Stats(pr).sort_stats("tottime").print_stats(18)
