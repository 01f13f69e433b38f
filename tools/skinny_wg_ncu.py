"""A few launches of the 16-row wgmma skinny tile for Nsight Compute, 16 rows of an N x K
weight (default 16384 x 16384). Usage (on the device):
  ncu --clock-control none -k regex:gemm_skinny_16wg -s 3 -c 1 --section SpeedOfLight \
      --section WarpStateStats --section Occupancy python tools/skinny_wg_ncu.py [N K]"""
import sys

import torch

from cupyfuse import interop
from skinny_wg_probe import FORMS, wg

N, K = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (16384, 16384)
w = torch.randn(N, K, device="cuda") / K ** 0.5
x = torch.randn(16, K, device="cuda")
out = torch.empty(16, N, device="cuda")
with interop.Call.begin("probe", x, {}, x_shape_msg=""):
    for _ in range(5):
        wg(x, w, out, *FORMS[0][1:])
torch.cuda.synchronize()
