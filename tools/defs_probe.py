"""98 (or other KernelBench models) under KernelBench's timing with compile-time variants
of the kernels: every kernel this process compiles gets the macros of the environment's
CF_PROBE_DEFS (e.g. "-DCF_CERT_BATCH=2"; the twentieth session used it for L2 cache-hint
hooks, since removed: ENGINE_NOTES v28). One variant per process: run several processes,
interleaved (the card's clocks drift), and compare their GPU sums.

Usage: CF_PROBE_DEFS="..." PYTHONPATH=.:tools python tools/defs_probe.py LABEL [--reps N]
       [--models 98 80] [--splits S]"""
import argparse
import copy
import glob
import importlib.util
import os
import shlex

import cupy
import torch

import cupyfuse
from cupyfuse import models
from cupyfuse import nn as cnn
from _kbtime import kernel_times, timed

ap = argparse.ArgumentParser()
ap.add_argument("label")
ap.add_argument("--reps", type=int, default=50)
ap.add_argument("--models", nargs="*", default=["98"])
ap.add_argument("--splits", type=int, default=None,
                help="K splits of the one-pass GEMM where it would split (engine.wide_splits)")
opts = ap.parse_args()
EXTRA = tuple(shlex.split(os.environ.get("CF_PROBE_DEFS", "")))
_raw = cupy.RawModule


def _raw_with_defs(*args, options=(), **kw):
    return _raw(*args, options=tuple(options) + EXTRA, **kw)


cupy.RawModule = _raw_with_defs
dev = torch.device("cuda")
if opts.splits is not None:
    from cupyfuse import engine
    _ws = engine.wide_splits
    engine.wide_splits = lambda *a, **k: opts.splits if _ws(*a, **k) > 1 else 1
for name in opts.models:
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
    f = cnn.from_model(model)
    with torch.no_grad():
        y = f(x)
        ref = copy.deepcopy(model).double()(x.double())
    torch.cuda.synchronize()
    err = float(((y.double() - ref.double()).abs() / (ref.double().abs() + 1)).max())
    t = timed(lambda: f(x), opts.reps)
    rows = kernel_times(lambda: f(x))
    ks = ", ".join(f"{n[:14]} {v:.1f}" for n, v in sorted(rows.items(), key=lambda kv: -kv[1]))
    print(f"{name} {opts.label:24s} KB {t * 1e3:6.1f} us  err {err:.1e}  GPU "
          f"{sum(rows.values()):.1f}: {ks}", flush=True)
