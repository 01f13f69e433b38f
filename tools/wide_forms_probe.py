"""The one-pass (TF32/BF16) GEMM's forms side by side: 128-row tiles, 128-row tiles in
clusters of 2 along M (B boxes multicast, engine.WIDE_CLUSTER), 192-row tiles (three
consumer warpgroups, engine.WIDE_BM). Per shape: error against float64, bitwise agreement
of the two 128-row forms, cold-L2 time of each (its own K splits); then 98 and 80 under
KernelBench's conditions (grad mode, parameters requiring grad, L2 flushed) with their
kernels, and what the default plan (engine.wide_plan) picks.

Usage: PYTHONPATH=.:tools python tools/wide_forms_probe.py [--reps N] [--no-models]"""
import argparse
import glob
import importlib.util

import torch

import cupyfuse
from cupyfuse import engine, models
from cupyfuse import nn as cnn
from _kbtime import kernel_times, timed

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=50)
ap.add_argument("--no-models", action="store_true")
opts = ap.parse_args()
dev = torch.device("cuda")
sm = torch.cuda.get_device_properties(0).multi_processor_count
print(torch.cuda.get_device_name(), flush=True)
FORMS = {"128": (1, 128), "128x2": (2, 128), "192": (1, 192)}


def use(form):
    engine.WIDE_CLUSTER, engine.WIDE_BM = FORMS[form]


ok = True
SHAPES = [(1024, 512, 8192), (1024, 8192, 8192), (4096, 4096, 4096), (8192, 8192, 8192),
          (300, 1040, 1000), (129, 256, 64), (2000, 768, 336), (512, 4096, 4096),
          (2048, 2048, 2048), (16384, 4096, 1024)]
for M, N, K in SHAPES:
    for dt in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        a = torch.randn(M, K, device=dev)
        b = torch.randn(N, K, device=dev)
        if dt == torch.bfloat16:
            a, b = engine.to_bf16(a), engine.to_bf16(b)
        ref = a.float().double() @ b.float().double().T
        outs, times, errs = {}, {}, {}
        for form in FORMS:
            use(form)
            out = torch.full((M, N), float("nan"), device=dev)
            engine.gemm_wide(a, b, out)
            torch.cuda.synchronize()
            outs[form] = out.clone()
            errs[form] = float(((out.double() - ref).abs() / (ref.abs() + K ** 0.5)).max())
            times[form] = timed(lambda: engine.gemm_wide(a, b, out), opts.reps)
        same = torch.equal(outs["128"], outs["128x2"])
        good = same and max(errs.values()) < (1e-2 if dt == torch.bfloat16 else 2e-3) and \
            not any(o.isnan().any() for o in outs.values())
        ok &= good
        engine.WIDE_CLUSTER, engine.WIDE_BM = 1, None
        pick = engine.wide_plan(M, N, K, sm, a.element_size())
        ts = "  ".join(f"{f} {t * 1e3:7.1f}" for f, t in times.items())
        print(f"{'ok' if good else 'FAIL':4s} {M}x{N}x{K} {str(dt)[6:]:8s} err {max(errs.values()):.2g}"
              f"  us: {ts}   plan: {pick.bm} rows, {pick.splits} splits", flush=True)
        del a, b, out, outs, ref
        torch.cuda.empty_cache()

for name in ([] if opts.no_models else ("98", "80")):
    torch.manual_seed(0)
    if name == "98":
        model = models.make_model(name, device="cuda")
        x = models.get_inputs(name, device="cuda")[0]
    else:
        path = glob.glob(f"tests/kernelbench/l2_{name}_*.py")[0]
        spec = importlib.util.spec_from_file_location("kb", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        model = mod.Model(*mod.get_init_inputs()).to(dev)
        x = mod.get_inputs()[0].to(dev)
    ys = {}
    for form in ("128", "192", "128", "192"):
        use(form)
        cupyfuse.clear_cache()
        f = cnn.from_model(model)
        with torch.no_grad():
            y = f(x)
        torch.cuda.synchronize()
        ys.setdefault(form, y)
        close = torch.allclose(ys["128"], y, atol=1e-5, rtol=1e-5)
        ok &= close
        t = timed(lambda: f(x), opts.reps)
        rows = kernel_times(lambda: f(x))
        ks = ", ".join(f"{n[:24]} {v:.1f}" for n, v in sorted(rows.items(), key=lambda kv: -kv[1]))
        print(f"  {name} {form}: KB {t:.4f} ms, close {close}; GPU "
              f"{sum(rows.values()):.1f} us: {ks}", flush=True)
    del model, x
    torch.cuda.empty_cache()
engine.WIDE_CLUSTER, engine.WIDE_BM = 1, None
print("ALL OK" if ok else "SOME FAILED")
