"""GPU time per kernel of each fused op at KernelBench size (torch.profiler / CUPTI sees the
CuPy-launched kernels too). Usage: PYTHONPATH=. python tools/kernel_times.py [55 56 98 39]"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from cupyfuse import models
from cupyfuse import nn as cnn

keys = sys.argv[1:] or ["55", "56", "98", "39"]
for key in keys:
    torch.manual_seed(0)
    model = models.make_model(key, device="cuda")
    fused = cnn.from_model(model)
    x = models.get_inputs(key, device="cuda")[0]
    with torch.no_grad():
        for _ in range(3):
            fused(x)
        torch.cuda.synchronize()
        reps = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fused(x)
            torch.cuda.synchronize()
    print(f"== {key}: GPU time per call by kernel (us)")
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rows[e.name] = rows.get(e.name, 0.0) + e.device_time / reps
    for name, t in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {t:9.1f}  {name[:90]}")
    print(f"  {sum(rows.values()):9.1f}  total")
    del model, fused, x
    torch.cuda.empty_cache()
