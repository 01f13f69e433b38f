"""Where a model's KernelBench time goes besides its kernels: per call (L2 flushed
before, grad mode), the gap from the flush kernel's end to our first kernel's start (the
host's work before its first launch, when the host is behind), the kernels' GPU times and
the gaps between them. Usage: PYTHONPATH=. python tools/kb_gaps.py [MODEL] (default 98)"""
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from cupyfuse import models
from cupyfuse import nn as cnn

name = sys.argv[1] if len(sys.argv) > 1 else "98"
torch.manual_seed(0)
model = models.make_model(name, device="cuda")
x = models.get_inputs(name, device="cuda")[0]
f = cnn.from_model(model)
L2 = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
for _ in range(5):
    L2.zero_()
    f(x)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        L2.zero_()
        f(x)
    torch.cuda.synchronize()
ks = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
            key=lambda e: e.time_range.start)
calls, cur = [], None
for e in ks:
    if "FillFunctor<unsigned char>" in e.name:
        cur = [e]
        calls.append(cur)
    elif cur is not None:
        cur.append(e)
first, gaps, kern = [], {}, {}
for c in calls[2:]:
    first.append(c[1].time_range.start - c[0].time_range.end)
    for a, b in zip(c[1:], c[2:]):
        gaps.setdefault(b.name[:24], []).append(b.time_range.start - a.time_range.end)
    for e in c[1:]:
        kern.setdefault(e.name[:24], []).append(e.time_range.end - e.time_range.start)
print(torch.cuda.get_device_name(), "model", name)
print(f"flush end -> first kernel: median {statistics.median(first):.1f} us")
for k, v in kern.items():
    g = gaps.get(k)
    print(f"  {k:24s} {statistics.median(v):6.1f} us" + (f"   gap before {statistics.median(g):.1f} us" if g else ""))
total = statistics.median(first) + sum(statistics.median(v) for v in kern.values()) + \
    sum(statistics.median(v) for v in gaps.values())
print(f"sum: {total:.1f} us")
