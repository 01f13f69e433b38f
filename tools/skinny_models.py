"""Whole models at skinny batches of a 16384^2 weight (issue 10's "batch <= 16 within 1.1x of
the fp32-weight floor": 56 at batch 1 <= 0.40 ms): bench --sweep's module cells (its
cold-L2 pair timer, the fused module vs the original, grad mode and no_grad), ms and the
ratio to the floor (the weight's bytes at 3.0 TB/s).
Usage: PYTHONPATH=. python tools/skinny_models.py [--features F] [--reps N]"""
import argparse

import torch

from cupyfuse import bench_sweep, interop


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--problems", default="56,55,gen")
    a = ap.parse_args()
    dev = torch.device("cuda")
    f = a.features
    floor = f * f * 4 / 3.0e12 * 1e3
    timer = bench_sweep._timer(dev)
    print(f"features {f}, floor {floor:.4f} ms ({torch.cuda.get_device_name()})")
    print("| problem | batch | mode | eager ms | cupyfuse ms | vs floor | vs eager |")
    print("|---|---|---|---|---|---|---|")
    for p in a.problems.split(","):
        for b in (1, 4, 8, 9, 12, 13, 16):
            for mode in ("module_grad", "module_nograd"):
                c = bench_sweep._module_cell(p, b, f, mode, dev, timer, a.reps)
                e, o = c["baseline_ms"], c["cupyfuse_ms"]
                print(f"| {p} | {b} | {mode} | {e:.4f} | {o:.4f} | {o / floor:.2f} | {e / o:.2f}x |",
                      flush=True)


if __name__ == "__main__":
    with interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg=""):
        main()
