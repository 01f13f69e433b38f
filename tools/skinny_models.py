"""Whole models at skinny batches of a 16384^2 weight (issue 10's "batch <= 16 within 1.1x of
the fp32-weight floor": 56 at batch 1 <= 0.40 ms): bench --sweep's module cells (its
cold-L2 pair timer, the fused module vs the original, grad mode and no_grad), ms and the
ratio to the floor (the weight's bytes at 3.0 TB/s).
--profile: per-kernel GPU time of each model's call (torch profiler, warm L2) at 1, 9, 16 rows.
Usage: PYTHONPATH=. python tools/skinny_models.py [--features F] [--reps N] [--profile]"""
import argparse

import torch

from cupyfuse import bench_sweep, interop


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--problems", default="56,55,gen")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    if a.profile:
        return profile(a)
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


def profile(a):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    from cupyfuse import nn as cnn
    dev = torch.device("cuda")
    for p in a.problems.split(","):
        torch.manual_seed(0)
        orig = bench_sweep._model(p, a.features, dev)
        fused = cnn.from_model(orig)
        for b in (1, 9, 16):
            x = torch.rand(b, a.features, device=dev)
            with torch.no_grad():
                for _ in range(5):
                    fused(x)
                torch.cuda.synchronize()
                with tprof(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        fused(x)
                    torch.cuda.synchronize()
            rows = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    r = rows.setdefault(e.name[:50], [0, 0.0])
                    r[0] += 1
                    r[1] += e.device_time_total
            print(f"{p} batch {b}: " + "; ".join(f"{k} {c / 10:.0f}x {us / 10:.1f} us"
                                              for k, (c, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])),
                  flush=True)


if __name__ == "__main__":
    with interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg=""):
        main()
