"""Model 98 at KernelBench's size, a few calls, for Nsight Compute on the certification
kernel (cupyfuse/certify.py). Usage (on the device):
  ncu --clock-control none -k regex:cf_cert -s 3 -c 1 --section SpeedOfLight \
      --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
      python tools/certify_ncu.py
(-k regex:gemm_sm90_wide for the TF32 GEMM before it)"""
import torch

from cupyfuse import models
from cupyfuse import nn as cnn

torch.manual_seed(0)
model = models.make_model("98", device="cuda")
x = models.get_inputs("98", device="cuda")[0]
f = cnn.from_model(model)
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
with torch.no_grad():
    for _ in range(6):
        flush.zero_()
        f(x)
torch.cuda.synchronize()
