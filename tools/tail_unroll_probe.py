"""Wide-row tails at skinny batches: the generated level kernel's loop unroll
(codegen.UNROLL) against the model's cold-L2 time and the tail kernel's own GPU time
(profiler), 56's and gen's tails on a 1024 -> 16384 Linear at batch 1, 9, 16.
Usage: PYTHONPATH=. python tools/tail_unroll_probe.py"""
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import cupyfuse
from cupyfuse import bench_sweep, codegen, interop
from cupyfuse import nn as cnn

warnings.simplefilter("ignore")
DEV = torch.device("cuda")


class M56(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.l = torch.nn.Linear(i, o)

    def forward(self, x):
        return torch.sigmoid(self.l(x)).sum(dim=1, keepdim=True)


def tail_us(fused, x):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fused(x)
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "tail" in e.name) / 10


def main():
    timer = bench_sweep._timer(DEV)
    print("| model | batch | unroll | model ms (cold L2) | eager ms | tail us (warm) |")
    print("|---|---|---|---|---|---|")
    for name, cls in (("gen", bench_sweep.GeluSoftmax), ("56", M56)):
        torch.manual_seed(0)
        orig = cls(1024, 16384).to(DEV)
        for b in (1, 9, 16):
            x = torch.rand(b, 1024, device=DEV)
            for u in ("#pragma unroll 4", "#pragma unroll 8", "#pragma unroll 16", "#pragma unroll"):
                codegen.UNROLL = u
                codegen._plans.clear()
                cupyfuse.clear_cache()
                fused = cnn.from_model(orig)
                with torch.no_grad():
                    e, o = timer(lambda: orig(x), lambda: fused(x), 30)
                    t = tail_us(fused, x)
                print(f"| {name} | {b} | {u[8:] or 'full'} | {o:.4f} | {e:.4f} | {t:.1f} |", flush=True)


if __name__ == "__main__":
    with interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg=""):
        main()
