"""56 at batch 512, 1024^2 as a module in grad mode: kernels per call (why slower than the
function?). PYTHONPATH=. python tools/diag_grad56.py"""
import torch
from torch.profiler import ProfilerActivity, profile

from cupyfuse import fused, models
from cupyfuse import nn as cnn

with torch.device("cuda"):
    orig = models.MatmulSigmoidSum(1024, 1024)
f = cnn.from_model(orig)
x = torch.rand(512, 1024, device="cuda")
for _ in range(5):
    f(x)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        f(x)
    torch.cuda.synchronize()
rows = {}
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        rows[e.name[:70]] = rows.get(e.name[:70], 0) + 1
print(rows)
print("graphs:", len(f._graphs), "fast entries:", [(k[1], v is not None) for k, v in fused._fast_fn.items()])
