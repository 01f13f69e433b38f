"""The sweep's slow cells, taken apart on the GPU (bench --sweep's cold-L2 median timer).

1. Batch 1, 1024^2 to 16384^2: the skinny GEMM alone, the prepared call with the tail in
   the same launch, with the tail as a second launch, and eager -- for 56's and gen's tails.
2. Kernels per call (torch profiler, CUDA time per kernel) and host time per call for the
   cells listed in CELLS.
Usage: PYTHONPATH=. python tools/cells_probe.py [part...]   (parts: wide, cells)
"""
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import cupyfuse
from cupyfuse import bench_sweep, engine, interop, models, prepared
from cupyfuse import nn as cnn

torch.backends.cuda.matmul.allow_tf32 = False
DEV = torch.device("cuda")
gpu_time = bench_sweep._timer(DEV)


def t56(h):
    return torch.sigmoid(h).sum(dim=1, keepdim=True)


def tgen(h):
    return torch.softmax(F.gelu(h), dim=1)


def wide() -> None:
    width_default = prepared.FUSE_MAX_WIDTH
    print("| F | tail | GEMM alone ms | one launch | two launches | eager |")
    print("|---|---|---|---|---|---|")
    for f in (1024, 2048, 4096, 16384):
        w = torch.randn(f, f, device=DEV) / f ** 0.5
        b = torch.randn(f, device=DEV)
        x = torch.randn(1, f, device=DEV)
        out = torch.empty(1, f, device=DEV)
        call = interop.Call.begin("probe", x, {}, x_shape_msg="")
        with call:
            g = gpu_time(lambda: engine.gemm_skinny(x, w, out), 30)
        for name, tail in (("56", t56), ("gen", tgen)):
            res = []
            for fuse in (True, False):
                prepared.FUSE_TAIL = fuse
                prepared.FUSE_MAX_WIDTH = 1 << 30 if fuse else 0
                cupyfuse.clear_cache()
                res.append(gpu_time(lambda: cupyfuse.fused_linear(x, w, b, tail), 30))
            prepared.FUSE_TAIL, prepared.FUSE_MAX_WIDTH = True, width_default
            e = gpu_time(lambda: tail(F.linear(x, w, b)), 30)
            print(f"| {f} | {name} | {g:.4f} | {res[0]:.4f} | {res[1]:.4f} | {e:.4f} |", flush=True)


def _profile(fn, n: int = 10) -> None:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(e.name[:60], [0, 0.0])
            r[0] += 1
            r[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    for k, (c, us) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print(f"    {c / n:5.1f}/call {us / n:8.1f} us/call  {k}")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    print(f"    wall per call (back to back): {(time.perf_counter() - t0) / 50 * 1e6:.1f} us")


def cells() -> None:
    import cupy

    torch.manual_seed(0)
    m56 = models.MatmulSigmoidSum(1024, 1024).to(DEV)
    f56 = cnn.from_model(m56)
    x = torch.rand(512, 1024, device=DEV)
    for mode in ("grad", "no_grad"):
        with torch.set_grad_enabled(mode == "grad"):
            print(f"56 module {mode} 512x1024: fused {gpu_time(lambda: f56(x), 30):.4f} ms, "
                  f"eager {gpu_time(lambda: m56(x), 30):.4f} ms")
            _profile(lambda: f56(x))
    gen = bench_sweep.GeluSoftmax(1024, 1024).to(DEV)
    fg = cnn.from_model(gen)
    x = torch.rand(4096, 1024, device=DEV)
    with torch.no_grad():
        print(f"gen module no_grad 4096x1024: fused {gpu_time(lambda: fg(x), 30):.4f} ms, "
              f"eager {gpu_time(lambda: gen(x), 30):.4f} ms")
        _profile(lambda: fg(x))
    w = cupy.random.rand(1024, 1024, dtype=cupy.float32) - 0.5
    b = cupy.random.rand(1024, dtype=cupy.float32)
    xc = cupy.random.rand(4096, 1024, dtype=cupy.float32)
    pw = cupyfuse.prepare_weight(w)
    print(f"56 function CuPy 4096x1024: fused {gpu_time(lambda: cupyfuse.matmul_sigmoid_sum(xc, pw, b), 30):.4f} ms")
    _profile(lambda: cupyfuse.matmul_sigmoid_sum(xc, pw, b))


def grad39() -> None:
    import cProfile
    import pstats

    for batch, f in ((4096, 1024), (32, 512)):
        torch.manual_seed(0)
        m = models.GemmScaleBatchNorm(f, f, (f,)).to(DEV)
        fm = cnn.from_model(m)
        x = torch.rand(batch, f, device=DEV)
        for mode in ("grad", "no_grad"):
            with torch.set_grad_enabled(mode == "grad"):
                print(f"39 module {mode} {batch}x{f}: fused {gpu_time(lambda: fm(x), 30):.4f} ms, "
                      f"eager {gpu_time(lambda: m(x), 30):.4f} ms", flush=True)
                _profile(lambda: fm(x))
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(200):
                    fm(x)
                torch.cuda.synchronize()
                pr.disable()
                pstats.Stats(pr).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["wide", "cells"]
    for p in parts:
        globals()[p]()
