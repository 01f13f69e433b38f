"""Host time per call of each fused op at KernelBench size, and where it goes.

Two measures: (a) each call timed alone, the GPU idle when it starts (as do_bench starts
its clock); (b) 50 calls back to back (the GPU busy). Then, for one problem, the time
spent inside the main host-side steps (wrappers accumulate perf_counter time).
Usage: PYTHONPATH=. python tools/host_gap.py [problem to break down]"""
import sys
import time
from collections import defaultdict

import torch

from cupyfuse import engine, gemm, interop, models, ops, plans, runtime
from cupyfuse import nn as cnn

acc = defaultdict(float)
cnt = defaultdict(int)


def wrap(mod, name):
    fn = getattr(mod, name)

    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[f"{mod.__name__}.{name}"] += time.perf_counter() - t
            cnt[f"{mod.__name__}.{name}"] += 1
    setattr(mod, name, w)


key_bd = sys.argv[1] if len(sys.argv) > 1 else "56"
for key in ["55", "56", "98", "39"]:
    torch.manual_seed(0)
    model = models.make_model(key, device="cuda")
    fused = cnn.from_model(model)
    x = models.get_inputs(key, device="cuda")[0]
    with torch.no_grad():
        for _ in range(3):
            fused(x)
        alone = []
        for _ in range(20):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fused(x)
            alone.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            fused(x)
        busy = (time.perf_counter() - t) / 50
        torch.cuda.synchronize()
        alone.sort()
        print(f"{key}: host us per call: GPU idle at start {alone[10] * 1e6:.0f} (min "
              f"{alone[0] * 1e6:.0f}); back to back {busy * 1e6:.0f}")
        if key == key_bd:
            for mod, names in [(ops, ["launch", "_begin", "_check_linear"]),
                               (engine, ["launch", "encode_tensor_map", "split_hybrid",
                                         "gemm_hybrid", "gemm_wide"]),
                               (gemm, ["linear_nobias"]), (plans, ["cached"]),
                               (interop.Call, ["empty", "result", "__enter__", "__exit__"]),
                               (runtime, ["get_function"])]:
                for n in names:
                    if hasattr(mod, n):
                        wrap(mod, n)
            orig_sync = torch.cuda.synchronize
            for _ in range(20):
                orig_sync()
                t = time.perf_counter()
                fused(x)
                acc["TOTAL fused(x)"] += time.perf_counter() - t
                cnt["TOTAL fused(x)"] += 1
            orig_sync()
            for k in sorted(acc, key=lambda k: -acc[k]):
                print(f"   {acc[k] / 20 * 1e6:8.1f} us/call  ({cnt[k] / 20:.0f} calls)  {k}")
    del model, fused, x
    torch.cuda.empty_cache()
