"""Split-K sum in the tail kernel (prepared.KSUM_IN_TAIL) on vs off, A/B in one process:
the prepared engine launches (batches 17-512) of a multi-pass tail (softmax of gelu) and
a one-pass tail (sigmoid row sum). Per cell: bench --sweep's interleaved cold-L2 timer
(GPU + launch time, ms) and the tight-loop host time (us), and the launches per call.
Usage: PYTHONPATH=. python tools/ksum_probe.py"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import cupyfuse
from cupyfuse import bench_sweep, prepared
from _hosttime import us

torch.backends.cuda.matmul.allow_tf32 = False
DEV = torch.device("cuda")
pair = bench_sweep._timer(DEV)


class Net(nn.Module):
    def __init__(self, k, n, tail):
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.tail = tail

    def forward(self, x):
        h = self.fc(x)
        if self.tail == "softmax(gelu)":
            return torch.softmax(F.gelu(h), dim=1)
        return torch.sigmoid(h).sum(dim=1, keepdim=True)


print("| tail | batch | K = N | launches on/off | GPU ms on | off | on/off | host us on | off |")
print("|---|---|---|---|---|---|---|---|---|")
for tail in ("softmax(gelu)", "sigmoid sum"):
    for batch, f in ((32, 4096), (128, 1024), (128, 4096), (256, 2048), (512, 1024), (512, 4096)):
        torch.manual_seed(0)
        model = Net(f, f, tail).to(DEV)
        x = torch.randn(batch, f, device=DEV)
        fm = {}
        n = {}
        for on in (True, False):
            prepared.KSUM_IN_TAIL = on
            fm[on] = cupyfuse.from_model(model)
            with torch.no_grad():
                for _ in range(3):
                    fm[on](x)
            ent = [v for v in fm[on]._runner.fast.values() if v is not None]
            n[on] = len(ent[0][0].steps) if ent else 0
        with torch.no_grad():
            assert torch.equal(fm[True](x), fm[False](x))
            a, b = pair(lambda: fm[True](x), lambda: fm[False](x), 200)
            ha, hb = us(lambda: fm[True](x), 1000, 5), us(lambda: fm[False](x), 1000, 5)
        print(f"| {tail} | {batch} | {f} | {n[True]}/{n[False]} | {a:.4f} | {b:.4f} | "
              f"{a / b:.2f} | {ha:.1f} | {hb:.1f} |", flush=True)
prepared.KSUM_IN_TAIL = True
