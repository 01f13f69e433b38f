"""Speed of the outside-model features against eager PyTorch, called the way users call them:
derived weights (a cosine classifier), sequence reductions (mean and attention pooling over
(batch, seq, features)) and head splits (per-head softmax / LayerNorm), as fused_class
modules under no_grad and in grad mode (parameters requiring grad), at small and mid
batches. Times are the sweep's pair timer (interleaved calls, L2 flushed, CUDA events,
median). Each model is checked against eager first (max abs difference printed).
Usage: PYTHONPATH=. python tools/features_probe.py [--batches 1 8 64 512] [--reps 30]"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import cupyfuse
from cupyfuse.bench_sweep import _timer


class Cosine(nn.Module):
    def __init__(self, f=512, n=512):
        super().__init__()
        self.fc = nn.Linear(f, n, bias=False)
        self.s = 16.0

    def forward(self, x):
        return torch.softmax(F.linear(x, F.normalize(self.fc.weight, dim=1)) * self.s, dim=-1)


class MeanPool(nn.Module):
    def __init__(self, f=512, n=512):
        super().__init__()
        self.proj = nn.Linear(f, n)
        self.head = nn.Linear(n, 64)

    def forward(self, x):            # x (batch, seq, f)
        return self.head(F.gelu(self.proj(x)).mean(dim=1))


class AttnPool(nn.Module):
    def __init__(self, f=512, n=512):
        super().__init__()
        self.proj = nn.Linear(f, n)
        self.score = nn.Linear(n, 1)

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        a = torch.softmax(self.score(h), dim=1)
        return (a * h).sum(dim=1)


class Heads(nn.Module):
    def __init__(self, f=512, n=512, heads=8):
        super().__init__()
        self.fc = nn.Linear(f, n)
        self.heads = heads
        self.ln = nn.LayerNorm(n // heads)

    def forward(self, x):
        h = self.fc(x)
        b = h.shape[0]
        h = self.ln(h.view(b, self.heads, -1))
        return torch.softmax(h, dim=-1).flatten(1)


MODELS = {"cosine": (Cosine, False), "meanpool": (MeanPool, True),
          "attnpool": (AttnPool, True), "heads": (Heads, False)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 8, 64, 512])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seq", type=int, default=16)
    args = ap.parse_args()
    dev = torch.device("cuda")
    pair = _timer(dev)
    print("| model | mode | batch | eager ms | fused ms | speedup | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    logs = {}
    for name, (cls, seq) in MODELS.items():
        torch.manual_seed(0)
        orig = cls().to(dev)
        fused = cupyfuse.fused_class(cls)().to(dev)
        fused.load_state_dict(orig.state_dict())
        for b in args.batches:
            x = torch.randn((b, args.seq, 512) if seq else (b, 512), device=dev)
            for mode in ("no_grad", "grad"):
                ctx = torch.no_grad() if mode == "no_grad" else torch.enable_grad()
                with ctx:
                    diff = (orig(x) - fused(x)).abs().max().item()
                    te, tf = pair(lambda: orig(x), lambda: fused(x), args.reps)
                r = te / tf
                logs.setdefault(mode, []).append(math.log(r))
                print(f"| {name} | {mode} | {b} | {te:.4f} | {tf:.4f} | {r:.2f}x | {diff:.1e} |",
                      flush=True)
    for mode, v in logs.items():
        print(f"geometric mean {mode}: {math.exp(sum(v) / len(v)):.2f}x "
              f"(lowest {math.exp(min(v)):.2f}x)")


if __name__ == "__main__":
    main()
