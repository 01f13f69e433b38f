"""Memory after each call of the small fused models (test_ten_thousand_calls_leave_memory
_where_it_was, taken apart); "39-general": 39 with prepared launches off (the general
path every call). PYTHONPATH=. python tools/mem_probe.py"""
import torch

from cupyfuse import fused, interop, models
from cupyfuse import nn as cnn

interop.poison_outputs = False
orig_try = fused._try_prepare
for problem in ["55", "56", "98", "39", "39-general"]:
    fused._try_prepare = (lambda *a, **k: None) if problem.endswith("general") else orig_try
    p = problem.split("-")[0]
    torch.manual_seed(0)
    init = {"55": (96, 70, 2, 0.5), "56": (96, 70), "98": (96, 64, 4, 2.0),
            "39": (96, 70, (70,))}[p]
    fm = cnn.from_model(models.PROBLEMS[p].model(*init).cuda())
    x = torch.rand(32, init[0], device="cuda")
    mem = []
    calls = {"n": 0}
    real = fused.run_gpu

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)
    fused.run_gpu = counting
    with torch.no_grad():
        for i in range(12):
            fm(x)
            torch.cuda.synchronize()
            mem.append(torch.cuda.memory_allocated())
        for _ in range(500):
            fm(x)
        torch.cuda.synchronize()
        mem.append(torch.cuda.memory_allocated())
    fused.run_gpu = real
    print(problem, "general-path calls:", calls["n"], "memory growth:",
          [m - mem[0] for m in mem], flush=True)
