"""The wide (one-pass) GEMM with and without clusters of 2 along M (B boxes multicast,
engine.WIDE_CLUSTER): bitwise agreement, GEMM time per shape (cold L2), then models 98
and 80 under KernelBench's conditions (grad mode, parameters requiring grad, L2 flushed)
and their kernels.

Usage: PYTHONPATH=. python tools/wide_cluster_probe.py [--reps N]"""
import argparse

import torch

import cupyfuse
from cupyfuse import engine, models
from cupyfuse import nn as cnn
from _kbtime import kernel_times, timed

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=50)
opts = ap.parse_args()
dev = torch.device("cuda")
print(torch.cuda.get_device_name(), flush=True)
ok = True
SHAPES = [(1024, 512, 8192), (1024, 8192, 8192), (4096, 4096, 4096), (300, 1040, 1000),
          (129, 256, 64), (2000, 768, 336)]
for M, N, K in SHAPES:
    for dt in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        a = torch.randn(M, K, device=dev)
        b = torch.randn(N, K, device=dev)
        if dt == torch.bfloat16:
            a, b = engine.to_bf16(a), engine.to_bf16(b)
        outs, times = {}, {}
        for cl in (1, 2):
            engine.WIDE_CLUSTER = cl
            out = torch.full((M, N), float("nan"), device=dev)
            engine.gemm_wide(a, b, out)
            torch.cuda.synchronize()
            outs[cl] = out.clone()
            times[cl] = timed(lambda: engine.gemm_wide(a, b, out), opts.reps)
        ref = (a.double() if dt == torch.float32 else a.float().double()) @ \
              (b.double() if dt == torch.float32 else b.float().double()).T
        base = outs[1]
        same = all(torch.equal(base, o) for o in outs.values())
        err = float(((base.double() - ref).abs() / (ref.abs() + K ** 0.5)).max())
        good = same and err < (1e-2 if dt == torch.bfloat16 else 2e-3) and not base.isnan().any()
        ok &= good
        ts = "  ".join(f"cluster {cl} {t * 1e3:.1f}" for cl, t in times.items())
        print(f"{'ok' if good else 'FAIL':4s} {M}x{N}x{K} {str(dt)[6:]:8s} equal {same} err {err:.2g}"
              f"  us: {ts}", flush=True)
        del a, b, out, outs, ref
        torch.cuda.empty_cache()


for name in ("98", "80"):
    torch.manual_seed(0)
    model = models.make_model(name, device="cuda") if name == "98" else None
    if model is None:
        import glob
        import importlib.util
        path = glob.glob("tests/kernelbench/l2_80_*.py")[0]
        spec = importlib.util.spec_from_file_location("kb80", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        model = mod.Model(*mod.get_init_inputs()).to(dev)
        x = mod.get_inputs()[0].to(dev)
    else:
        x = models.get_inputs(name, device="cuda")[0]
    ys = {}
    for cl in (1, 2, 1, 2):
        engine.WIDE_CLUSTER = cl
        cupyfuse.clear_cache()
        f = cnn.from_model(model)
        with torch.no_grad():
            y = f(x)
        torch.cuda.synchronize()
        ys.setdefault(cl, y)
        same = torch.equal(ys[1], y)
        ok &= same
        t = timed(lambda: f(x), opts.reps)
        rows = kernel_times(lambda: f(x))
        ks = ", ".join(f"{n[:22]} {v:.1f}" for n, v in sorted(rows.items(), key=lambda kv: -kv[1]))
        print(f"  {name} cluster {cl}: KB {t:.4f} ms, same {same}; GPU "
              f"{sum(rows.values()):.1f} us: {ks}", flush=True)
    del model, x
    torch.cuda.empty_cache()
engine.WIDE_CLUSTER = 1
print("ALL OK" if ok else "SOME FAILED")
