"""Does timing PyTorch eager first (as the bench does) change cupyfuse's time afterwards?
do_bench (median, L2 flush) of fused(x): on a cool GPU, after ~10 s of eager runs, and again
after a 10 s pause. SM clock read with nvidia-smi at each step.
Usage: PYTHONPATH=. python tools/order_effect.py [problem]"""
import subprocess
import sys
import time

import torch
from triton.testing import do_bench

from cupyfuse import models
from cupyfuse import nn as cnn


def clock() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception as exc:  # pragma: no cover
        return f"? ({exc})"


key = sys.argv[1] if len(sys.argv) > 1 else "56"
torch.manual_seed(0)
model = models.make_model(key, device="cuda")
fused = cnn.from_model(model)
x = models.get_inputs(key, device="cuda")[0]
with torch.no_grad():
    fused(x)
    torch.cuda.synchronize()
    print(f"{key} cool:         fused {do_bench(lambda: fused(x), warmup=25, rep=500, return_mode='median'):.3f} ms  [{clock()}]")
    t = time.time()
    while time.time() - t < 10:
        e = do_bench(lambda: model(x), warmup=25, rep=1000, return_mode="median")
    print(f"{key} eager ~10 s:  eager {e:.3f} ms  [{clock()}]")
    print(f"{key} right after:  fused {do_bench(lambda: fused(x), warmup=25, rep=500, return_mode='median'):.3f} ms  [{clock()}]")
    time.sleep(10)
    print(f"{key} after 10 s:   fused {do_bench(lambda: fused(x), warmup=25, rep=500, return_mode='median'):.3f} ms  [{clock()}]")
    t = time.time()
    while time.time() - t < 10:
        f = do_bench(lambda: fused(x), warmup=25, rep=1000, return_mode="median")
    print(f"{key} fused ~10 s:  fused {f:.3f} ms  [{clock()}]")
