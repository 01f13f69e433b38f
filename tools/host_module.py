"""Where a fused module's host time goes at a launch-bound size (batch 32, 512 x 512):
the whole call and each layer below it timed alone in a tight loop (us per call, median
of 7 rounds), then a cProfile of the whole call. PYTHONPATH=. python tools/host_module.py"""
import cProfile
import pstats

import torch
import torch.nn as nn

import cupyfuse
from cupyfuse import fused, gemm, models
from cupyfuse import prepared as prep
from _hosttime import us


class Gen(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.fc = nn.Linear(k, n)

    def forward(self, x):
        return torch.softmax(torch.nn.functional.gelu(self.fc(x)), dim=1)


d = torch.device("cuda", 0)
x = torch.rand(32, 512, device=d)
x32 = x
x128 = torch.rand(128, 1024, device=d)   # the engine's batches: split, GEMM, split-K sum, tail
cases = {
    "56 module (named class)": (cupyfuse.nn.from_model(models.MatmulSigmoidSum(512, 512).to(d)), x),
    "gen module (fused_class)": (cupyfuse.fused_class(Gen)(512, 512).to(d), x),
    "gen FusedModel": (cupyfuse.from_model(Gen(512, 512).to(d)), x),
    "gen FusedModel, engine (batch 128, 1024^2)": (cupyfuse.from_model(Gen(1024, 1024).to(d)), x128),
    "gen FusedModel, engine, splitk_sum launch": (cupyfuse.from_model(Gen(1024, 1024).to(d)), x128),
}
for name, (m, x) in cases.items():
    prep.KSUM_IN_TAIL = "splitk_sum launch" not in name   # prepared at the first call below
    runner = m.__dict__.get("_cupyfuse_runner") or m.__dict__.get("_runner")
    inner = m.model if isinstance(m, fused.FusedModel) else m
    for grad in (False, True):
        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx:
            for _ in range(3):
                m(x)
            runner = m.__dict__.get("_cupyfuse_runner") or m.__dict__.get("_runner")
            ent = next(iter(runner.fast.values()))
            pr, paths = ent
            srcs = [get(inner) for get, _ in paths]
            sptrs = [t.data_ptr() for t in srcs]
            stream = prep.torch_stream(0)
            parts = {
                "m(x)": lambda: m(x),
                "m.forward(x)": lambda: m.forward(x),
                "runner.fast_call": lambda: runner.fast_call(inner, (x,), None),
                "prepared call": lambda: pr([x.data_ptr()], sptrs, stream, False, srcs, None),
                "snapshot": runner.snapshot,
                "dispatch_key": gemm.dispatch_key,
                "_stream_for": lambda: fused._stream_for(0, False),
                "torch.empty(out)": lambda: torch.empty(x.shape, device=d),
            }
            print(f"{name}, {'grad' if grad else 'no_grad'}: {len(pr.steps)} launches, "
                  f"ready plan {bool(pr._ready)}", flush=True)
            for k, f in parts.items():
                print(f"  {k:28s} {us(f, 3000):7.2f}", flush=True)
            # the same calls without the ready plan (prepared.Prepared.simple off), A/B
            saved = dict(pr._ready)
            pr.simple = False
            pr._ready.clear()
            for k in ("m(x)", "prepared call"):
                print(f"  {k + ' (no ready plan)':28s} {us(parts[k], 3000):7.2f}", flush=True)
            pr.simple = True
            pr._ready.update(saved)
            for k in ("m(x)", "prepared call"):
                print(f"  {k + ' (ready plan again)':28s} {us(parts[k], 3000):7.2f}", flush=True)
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        for _ in range(20000):
            m(x)
        prof.disable()
    torch.cuda.synchronize()
    print(f"cProfile, {name}, 20000 calls under no_grad (tottime):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
for grad in (False, True):
    ctx = torch.enable_grad() if grad else torch.no_grad()
    lin = nn.Linear(512, 512).to(d)
    with ctx:
        print(f"eager Linear+sigmoid+sum, {'grad' if grad else 'no_grad'}: "
              f"{us(lambda: torch.sigmoid(lin(x32)).sum(dim=1, keepdim=True)):.2f}")
