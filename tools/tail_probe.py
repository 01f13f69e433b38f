"""Wide-row tails at skinny batches, 56's and gen's tails on a 1024 -> 16384 Linear at
batch 1, 9, 16: the tail kernel's GPU time (profiler, warm) and the model's cold-L2 time
(bench --sweep's pair timer), in forms of the generated level kernel:
  (default) rows over a cluster, codegen.SPLIT_PARTS x SPLIT_THREADS (the `_cl` entry;
            1 part: one block per row);
  --unroll  the level kernels' loop unroll (codegen.UNROLL);
  --pdl     the tail launched plainly or as a programmatic dependent of the skinny GEMM
            (prepared.PDL_TAIL).
The outputs' bits are compared with the first form's, and the error with float64.
Usage: PYTHONPATH=. python tools/tail_probe.py [--unroll | --pdl]"""
import copy
import sys
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

import cupyfuse
from cupyfuse import bench_sweep, codegen, interop, prepared
from cupyfuse import nn as cnn

warnings.simplefilter("ignore")
DEV = torch.device("cuda")
# (label, the codegen settings)
SPLIT = [(f"{p} x {t}", {"SPLIT_PARTS": p, "SPLIT_THREADS": t})
         for p, t in ((1, 1024), (4, 1024), (8, 1024), (8, 512), (8, 256), (4, 256))]
PDL = [("plain", {"PDL_TAIL": False}), ("dependent", {"PDL_TAIL": True})]
UNROLL = [(u[8:] or "full", {"UNROLL": u}) for u in
          ("#pragma unroll 4", "#pragma unroll 8", "#pragma unroll 16", "#pragma unroll")]


class M56(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.l = torch.nn.Linear(i, o)

    def forward(self, x):
        return torch.sigmoid(self.l(x)).sum(dim=1, keepdim=True)


def tail_us(fused, x):
    """GPU us per call of the call's generated tail kernels (profiler, 10 calls)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fused(x)
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "tail" in e.name) / 10


def main(forms):
    timer = bench_sweep._timer(DEV)
    keep = {k: getattr(codegen, k) for _, f in forms for k in f if hasattr(codegen, k)}
    pdl = prepared.PDL_TAIL
    firsts = {}   # each (model, batch)'s output in the first form: the others' bits against it
    print("| model | batch | form | model ms (cold L2) | eager ms | tail us (warm) | bits vs first form | max err vs float64 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, cls in (("gen", bench_sweep.GeluSoftmax), ("56", M56)):
        torch.manual_seed(0)
        orig = cls(1024, 16384).to(DEV)
        ref64 = copy.deepcopy(orig).double()
        for b in (1, 9, 16):
            x = torch.rand(b, 1024, device=DEV)
            for label, settings in forms:
                for k, v in settings.items():
                    if k == "PDL_TAIL":
                        prepared.PDL_TAIL = v
                    else:
                        setattr(codegen, k, v)
                codegen._plans.clear()
                cupyfuse.clear_cache()
                fused = cnn.from_model(orig)
                with torch.no_grad():
                    e, o = timer(lambda: orig(x), lambda: fused(x), 30)
                    t = tail_us(fused, x)
                    y = fused(x)
                first = firsts.setdefault((name, b), y)
                same = "same" if torch.equal(y, first) else "DIFFER"
                err = (y.double() - ref64(x.double())).abs().max().item()
                print(f"| {name} | {b} | {label} | {o:.4f} | {e:.4f} | {t:.1f} | {same} | {err:.1e} |",
                      flush=True)
    for k, v in keep.items():
        setattr(codegen, k, v)
    prepared.PDL_TAIL = pdl


if __name__ == "__main__":
    with interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg=""):
        main(UNROLL if "--unroll" in sys.argv else PDL if "--pdl" in sys.argv else SPLIT)
