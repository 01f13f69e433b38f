"""cProfile of the host side of one fused op (98, small size): where Python time goes."""
import cProfile
import pstats

import torch

from cupyfuse import models
from cupyfuse import nn as cnn

torch.manual_seed(0)
model = models.PROBLEMS["98"].model(96, 64, 4, 2.0).cuda()
fused = cnn.from_model(model)
x = torch.rand(32, 96, device="cuda")
with torch.no_grad():
    for _ in range(20):
        fused(x)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        fused(x)
    pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
