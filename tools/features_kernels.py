"""GPU time per kernel of the features probe's models (tools/features_probe.py), eager and
fused, each call after an L2 flush (torch.profiler / CUPTI sees CuPy's launches too): where
a small batch's GPU time goes. Usage:
PYTHONPATH=.:tools python tools/features_kernels.py [--batches 1 64] [--models meanpool heads]"""
import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import cupyfuse
from features_probe import MODELS


def kernels(fn, flush, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "fill" not in ev.name \
                and "zero" not in ev.name.lower():
            per[ev.name[:60]] += ev.device_time / reps   # (us)
    return per


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 64])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(int(64e6), dtype=torch.float32, device=dev)
    for name in args.models:
        cls, seq = MODELS[name]
        torch.manual_seed(0)
        orig = cls().to(dev)
        fused = cupyfuse.fused_class(cls)().to(dev)
        fused.load_state_dict(orig.state_dict())
        for b in args.batches:
            x = torch.randn((b, 16, 512) if seq else (b, 512), device=dev)
            with torch.no_grad():
                for who, m in (("eager", orig), ("fused", fused)):
                    per = kernels(lambda: m(x), flush)
                    print(f"{name} batch {b} {who}: {sum(per.values()):.1f} us of kernels, "
                          f"{len(per)} kinds")
                    for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
                        print(f"    {v:7.2f}  {k}")


if __name__ == "__main__":
    main()
