"""Host-side cost per call of each fused op at small size (Python + launch), on the GPU."""
import time

import torch

from cupyfuse import models
from cupyfuse import nn as cnn

torch.manual_seed(0)
for key, init in [("55", (96, 70, 2, 0.5)), ("56", (96, 70)), ("98", (96, 64, 4, 2.0)),
                  ("39", (96, 70, (70,)))]:
    model = models.PROBLEMS[key].model(*init).cuda()
    fused = cnn.from_model(model)
    x = torch.rand(32, init[0], device="cuda")
    with torch.no_grad():
        for f, name in [(fused, "cupyfuse"), (model, "eager")]:
            for _ in range(20):
                f(x)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(500):
                f(x)
            host = (time.perf_counter() - t) / 500
            torch.cuda.synchronize()
            print(f"{key} {name:9s} host time per call {host * 1e6:7.1f} us")
