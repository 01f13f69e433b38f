"""Wide-row tails split over a cluster (codegen.SPLIT_PARTS blocks per row of
codegen.SPLIT_THREADS threads, the `_cl` entry): the tail kernel's GPU time (profiler,
warm) and the model's cold-L2 time, 56's and gen's tails on a 1024 -> 16384 Linear at
batch 1, 9, 16, against one block per row (parts 1).
Usage: PYTHONPATH=. python tools/tail_split_probe.py"""
import warnings

import torch

import cupyfuse
from cupyfuse import bench_sweep, codegen, interop
from cupyfuse import nn as cnn
from tail_unroll_probe import M56, tail_us

warnings.simplefilter("ignore")
DEV = torch.device("cuda")
FORMS = [(1, 1024), (4, 1024), (8, 1024), (8, 512), (8, 256), (4, 256)]


def main():
    timer = bench_sweep._timer(DEV)
    print("| model | batch | parts x threads | model ms (cold L2) | tail us (warm) |")
    print("|---|---|---|---|---|")
    for name, cls in (("gen", bench_sweep.GeluSoftmax), ("56", M56)):
        torch.manual_seed(0)
        orig = cls(1024, 16384).to(DEV)
        for b in (1, 9, 16):
            x = torch.rand(b, 1024, device=DEV)
            for parts, threads in FORMS:
                codegen.SPLIT_PARTS, codegen.SPLIT_THREADS = parts, threads
                codegen._plans.clear()
                cupyfuse.clear_cache()
                fused = cnn.from_model(orig)
                with torch.no_grad():
                    _, o = timer(lambda: orig(x), lambda: fused(x), 30)
                    t = tail_us(fused, x)
                print(f"| {name} | {b} | {parts} x {threads} | {o:.4f} | {t:.1f} |", flush=True)


if __name__ == "__main__":
    with interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg=""):
        main()
