"""Memory after each call of the small fused models (test_ten_thousand_calls_leave_memory
_where_it_was, taken apart). PYTHONPATH=. python tools/mem_probe.py"""
import torch

from cupyfuse import interop, models
from cupyfuse import nn as cnn

interop.poison_outputs = False
for problem in ["55", "56", "98", "39"]:
    torch.manual_seed(0)
    init = {"55": (96, 70, 2, 0.5), "56": (96, 70), "98": (96, 64, 4, 2.0),
            "39": (96, 70, (70,))}[problem]
    fused = cnn.from_model(models.PROBLEMS[problem].model(*init).cuda())
    x = torch.rand(32, init[0], device="cuda")
    mem = []
    with torch.no_grad():
        for i in range(12):
            fused(x)
            torch.cuda.synchronize()
            mem.append(torch.cuda.memory_allocated())
        for _ in range(500):
            fused(x)
        torch.cuda.synchronize()
        mem.append(torch.cuda.memory_allocated())
    print(problem, [m - mem[0] for m in mem], flush=True)
