"""Why a KernelBench model's fused call is slower in grad mode than under no_grad: per
mode, the KB timing (L2 flushed), which paths the calls took (specialised / prepared /
general), how often the specialised call was built, and the CUDA kernels of three calls.
Usage: PYTHONPATH=.:tools python tools/kb_grad_diag.py 84 [97 ...]"""
import contextlib
import sys
from collections import Counter

import torch

import cupyfuse
from cupyfuse import fastpath, fused as fz
from cupyfuse.bench_model import load_model_file, time_kb, _to
from tests.kernelbench.index import path_of

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
counts = Counter()


def wrap(obj, name, tag):
    f = getattr(obj, name)

    def g(*a, **k):
        r = f(*a, **k)
        counts[tag + ("" if r is not None else ":None")] += 1
        return r
    setattr(obj, name, g)


wrap(fastpath, "build", "build")
wrap(fz._Runner, "fast_call", "fast_call")
wrap(fz, "_run_module", "_run_module")

for num in map(int, sys.argv[1:]):
    mod = load_model_file(str(path_of(num)))
    init = mod.get_init_inputs()
    torch.manual_seed(0)
    orig = mod.Model(*init).to(dev)
    torch.manual_seed(0)
    f = cupyfuse.fused_class(mod.Model)(*init).to(dev)
    torch.manual_seed(3000)
    xs = _to(mod.get_inputs(), dev)
    f(*xs)
    print(f"== KB {num}", flush=True)
    for mode in ("grad", "no_grad", "grad"):
        ctx = torch.no_grad() if mode == "no_grad" else contextlib.nullcontext()
        with ctx:
            counts.clear()
            for en in (True, False):
                fastpath.ENABLED = en
                runner = f.__dict__["_cupyfuse_runner"]
                runner._spec = None
                runner._spec_key = None
                ms = time_kb(lambda: f(*xs), 10, dev)
                em = time_kb(lambda: orig(*xs), 10, dev)
                print(f"  {mode:8s} fastpath {en!s:5s}: fused {ms:.3f} ms eager {em:.3f} ms  "
                      f"paths {dict(counts)}", flush=True)
                counts.clear()
            fastpath.ENABLED = True
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                    torch.profiler.ProfilerActivity.CPU]) as p:
                for _ in range(3):
                    f(*xs)
                torch.cuda.synchronize()
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                         max_name_column_width=60), flush=True)
