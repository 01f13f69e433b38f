"""Where a fused module's prepared call spends its host time, by subtraction: the whole
call, then each layer, then fast_call with one piece replaced by its precomputed result
(the difference is that piece's cost). Batch 32, 512 x 512, model 56 (FusedModel), us per
call, the loop's host time (no synchronisation inside; median of rounds).
PYTHONPATH=.:tools python tools/fastcall_parts.py"""
import statistics
import time

import torch

from cupyfuse import fused, gemm, models
from cupyfuse import nn as cnn
from cupyfuse import prepared as prep


def us(fn, n=200, rounds=31):
    for _ in range(5):
        fn()
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


d = torch.device("cuda", 0)
torch.manual_seed(0)
m = cnn.from_model(models.MatmulSigmoidSum(512, 512).to(d))
x = torch.rand(32, 512, device=d)
with torch.no_grad():
    for _ in range(3):
        m(x)
inner = m.model if isinstance(m, fused.FusedModel) else m
runner = m.__dict__.get("_cupyfuse_runner") or m.__dict__.get("_runner")
with torch.no_grad():
    (pr, paths), = [v for v in runner.fast.values() if v is not None]
    srcs = [g(inner) for g, _ in paths]
    sptrs = [t.data_ptr() for t in srcs]
    stream = prep.torch_stream(0)
    out = m(x)
    snap = runner.snapshot(inner)
    real_snapshot, real_call = runner.snapshot, type(pr).__call__
    rows = {
        "m(x)": lambda: m(x),
        "m.forward(x)": lambda: m.forward(x),
        "_run_module": lambda: fused._run_module(inner, runner, (x,), None),
        "fast_call": lambda: runner.fast_call(inner, (x,), None),
        "prepared call": lambda: pr([x.data_ptr()], sptrs, stream, False, srcs, None),
        "snapshot": lambda: runner.snapshot(inner),
        "_structure": lambda: fused._structure(runner._parts, inner.__dict__),
        "dispatch_key": gemm.dispatch_key,
        "_stream_for": lambda: fused._stream_for(0, False),
        "source getters": lambda: [g(inner) for g, _ in paths],
        "torch.empty(32, 1)": lambda: torch.empty(32, 1, device=d),
        "x.data_ptr()": lambda: x.data_ptr(),
        "(x.shape, x.stride())": lambda: (x.shape, x.stride()),
    }
    res = {k: us(f) for k, f in rows.items()}
    runner.snapshot = lambda: snap
    res["fast_call, snapshot precomputed"] = us(lambda: runner.fast_call(inner, (x,), None))
    runner.snapshot = real_snapshot
    type(pr).__call__ = lambda self, *a: out
    res["fast_call, prepared call stubbed"] = us(lambda: runner.fast_call(inner, (x,), None))
    res["m(x), prepared call stubbed"] = us(lambda: m(x))
    type(pr).__call__ = real_call
print(f"{torch.cuda.get_device_name()}: host us per call ({type(m).__name__}, batch 32, 512^2, no_grad)")
for k, v in res.items():
    print(f"  {k:36s} {v:7.2f}")
