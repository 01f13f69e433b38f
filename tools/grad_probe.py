"""A KernelBench model's fused call in grad mode vs no_grad, alternated: KB timing, general
path runs and derived-weight builds per call. PYTHONPATH=. python tools/grad_probe.py 70 51"""
import sys

import torch

import cupyfuse
from cupyfuse import fused, plans
from cupyfuse.bench_model import load_model_file, time_kb
from pathlib import Path

dev = torch.device("cuda")
for num in sys.argv[1:]:
    path = next(Path("tests/kernelbench").glob(f"l2_{int(num):02d}_*.py"))
    mod = load_model_file(str(path))
    init = mod.get_init_inputs()
    torch.manual_seed(0)
    New = cupyfuse.fused_class(mod.Model)
    m = New(*init).to(dev)
    inputs = [t.to(dev) for t in mod.get_inputs()]
    counts = {"general": 0, "builds": 0}
    real_run, real_cached = fused.run_gpu, plans._cached

    def run_gpu(*a, **k):
        counts["general"] += 1
        return real_run(*a, **k)

    def cached(name, owner, deps, hyper, build):
        def b():
            counts["builds"] += 1
            return build()
        return real_cached(name, owner, deps, hyper, b)

    fused.run_gpu, plans._cached = run_gpu, cached
    for rnd in range(2):
        for mode in ("grad", "no_grad"):
            ctx = torch.no_grad() if mode == "no_grad" else torch.enable_grad()
            with ctx:
                for _ in range(3):
                    m(*inputs)
                torch.cuda.synchronize()
                counts.update(general=0, builds=0)
                t = time_kb(lambda: m(*inputs), 10, dev)
            print(f"{path.stem[:30]} round {rnd} {mode:8s} {t:.3f} ms; per call: general "
                  f"{counts['general'] / 13:.2f}, builds {counts['builds'] / 13:.2f}", flush=True)
    fused.run_gpu, plans._cached = real_run, real_cached
    del m
    torch.cuda.empty_cache()
