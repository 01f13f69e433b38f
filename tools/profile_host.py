"""Host-side cost of one fused op: cProfile (where) and wall time per call (how much).

98 at KernelBench size: the GPU needs ~0.2 ms per call, so the host must stay below.
"""
import cProfile
import pstats
import time

import torch

from cupyfuse import models
from cupyfuse import nn as cnn

torch.manual_seed(0)
model = models.make_model("98", "kernelbench", device="cuda")
fused = cnn.from_model(model)
x = torch.rand(1024, 8192, device="cuda")
with torch.no_grad():
    for _ in range(20):
        fused(x)
    torch.cuda.synchronize()
    for f, name in [(fused, "cupyfuse"), (model, "eager")]:
        t = time.perf_counter()
        for _ in range(200):
            f(x)
        host = (time.perf_counter() - t) / 200
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        for _ in range(200):
            f(x)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t2) / 200
        print(f"98 kernelbench {name:9s} host {host * 1e6:7.1f} us/call, wall {wall * 1e6:7.1f} us/call")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        fused(x)
    pr.disable()
    torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
