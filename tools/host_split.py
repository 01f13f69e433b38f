"""Host time per call measured two ways, for the sweep's host-cost cases (batch 32,
512 x 512): the CPU time of the loop alone (perf_counter before the final
synchronisation: what the caller's thread spends per call) and the loop with the final
synchronisation (max of host and GPU time per call when the GPU is the slower), plus the
GPU time per call from CUDA events around the loop. us per call, median of rounds.
``--ab``: the fused modules and torch functions only, with and without their specialised calls
(cupyfuse/fastpath.py), interleaved three times.
PYTHONPATH=.:tools python tools/host_split.py [--ab]"""
import sys
import statistics
import time

import cupy
import torch

import cupyfuse
from cupyfuse import models
from cupyfuse import nn as cnn


def split(fn, n=100, rounds=15):
    for _ in range(5):
        fn()
    host, wall, gpu = [], [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        for _ in range(n):
            fn()
        e1.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / n * 1e6)
        wall.append((t2 - t0) / n * 1e6)
        gpu.append(e0.elapsed_time(e1) / n * 1e3)
    return statistics.median(host), statistics.median(wall), statistics.median(gpu)


def tail(h):
    return torch.sigmoid(h).sum(dim=1, keepdim=True)


d = torch.device("cuda", 0)
torch.manual_seed(0)
orig = models.MatmulSigmoidSum(512, 512).to(d)
fm = cnn.from_model(orig)
fc = cupyfuse.fused_class(models.MatmulSigmoidSum)(512, 512).to(d)
x = torch.rand(32, 512, device=d)
w, b = orig.linear.weight.detach(), orig.linear.bias.detach()
xc, wc, bc = cupy.asarray(x), cupy.asarray(w), cupy.asarray(b)
pw = cupyfuse.prepare_weight(wc)
cases = {
    "eager module no_grad": (True, lambda: orig(x)),
    "fused module no_grad": (True, lambda: fm(x)),
    "fused_class no_grad": (True, lambda: fc(x)),
    "eager module grad": (False, lambda: orig(x)),
    "fused module grad": (False, lambda: fm(x)),
    "function torch (op)": (False, lambda: cupyfuse.matmul_sigmoid_sum(x, w, b)),
    "function torch (fused_linear)": (False, lambda: cupyfuse.fused_linear(x, w, b, tail)),
    "torch ops (baseline)": (False, lambda: torch.sigmoid(torch.addmm(b, x, w.t())).sum(1, keepdim=True)),
    "function cupy (op)": (False, lambda: cupyfuse.matmul_sigmoid_sum(xc, pw, bc)),
    "cupy ops (baseline)": (False, lambda: (1 / (1 + cupy.exp(-(xc @ wc.T + bc)))).sum(1, keepdims=True)),
}
print(f"{torch.cuda.get_device_name()}; us per call: host (loop, no sync) / wall (with sync) / GPU")
if "--ab" in sys.argv:
    from cupyfuse import fastpath

    def runners():
        return [m.__dict__.get("_runner", m.__dict__.get("_cupyfuse_runner")) for m in (fm, fc)]

    for rnd in range(3):
        for on in (True, False):
            fastpath.ENABLED = on
            for r in runners():
                if r is not None and not on:
                    r._spec = r._spec_key = None
            if not on:
                from cupyfuse import fused

                fused._fn_specs.clear()
                fused._fn_spec_state.clear()
            for name in ("fused module no_grad", "fused_class no_grad", "fused module grad",
                         "function torch (op)", "function torch (fused_linear)"):
                ng, fn = cases[name]
                with torch.no_grad() if ng else torch.enable_grad():
                    h, wl, g = split(fn)
                spec = [r._spec is not None for r in runners() if r is not None]
                print(f"  {'spec' if on else 'gen '} {name:28s} {h:7.2f} {wl:7.2f} {g:7.2f}"
                      f"  (specialised: {spec})", flush=True)
    sys.exit(0)
for name, (ng, fn) in cases.items():
    with torch.no_grad() if ng else torch.enable_grad():
        h, wl, g = split(fn)
    print(f"  {name:32s} {h:7.2f} {wl:7.2f} {g:7.2f}", flush=True)
