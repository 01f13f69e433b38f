"""Host cost of model 98's certified call (prepared launches): wall time per call of
back-to-back calls (no L2 flush: the GPU time per call is ~0.08 ms, so a wall time above
it is the host's), with and without the GPU's work in the way, and a cProfile of the
host side. Usage: PYTHONPATH=. python tools/certify_host.py"""
import cProfile
import pstats
import time

import torch

from cupyfuse import models
from cupyfuse import nn as cnn

torch.manual_seed(0)
model = models.make_model("98", device="cuda")
x = models.get_inputs("98", device="cuda")[0]
f = cnn.from_model(model)
for grad in (False, True):
    with torch.set_grad_enabled(grad):
        for _ in range(20):
            f(x)
        torch.cuda.synchronize()
        n = 300
        t0 = time.perf_counter()
        for _ in range(n):
            f(x)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"grad={grad}: host per call {1e6 * (t1 - t0) / n:.1f} us (calls queued), "
              f"wall per call {1e6 * (t2 - t0) / n:.1f} us", flush=True)
with torch.no_grad():
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        f(x)
    pr.disable()
    torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
