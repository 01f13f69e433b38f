"""Certified row maxima (cupyfuse/certify.py) on the GPU: accuracy against float64 and
candidate counts over shapes and data, then model 98's time under KernelBench's
conditions (grad mode, parameters requiring grad, L2 flushed before each call) with
certification on and off, and its kernels.

Usage: PYTHONPATH=. python tools/certify_probe.py [--general] [--reps N]
--general: the general path only (prepared launches off)."""
import argparse

import torch

import cupyfuse
from cupyfuse import certify, models, prepared
from cupyfuse import nn as cnn
from _kbtime import kernel_times, timed

ap = argparse.ArgumentParser()
ap.add_argument("--general", action="store_true")
ap.add_argument("--reps", type=int, default=50)
opts = ap.parse_args()
if opts.general:
    prepared.ENGINE_MAX_M = prepared.ENGINE_MAX_MK = prepared.ENGINE_MAX_MNK = 0
dev = torch.device("cuda")
print(torch.cuda.get_device_name(), flush=True)


class PoolMax(torch.nn.Module):
    def __init__(self, K, N, k, scale, act):
        super().__init__()
        self.lin = torch.nn.Linear(K, N)
        self.pool = torch.nn.AvgPool1d(k)
        self.scale, self.act = scale, act

    def forward(self, x):
        y = self.pool(self.lin(x).unsqueeze(1)).squeeze(1)
        y = self.act(y) * self.scale
        return y.max(dim=1).values if self.scale >= 0 else y.min(dim=1).values


def reference(m, x):
    md = PoolMax(m.lin.in_features, m.lin.out_features, m.pool.kernel_size[0], m.scale, m.act)
    md.load_state_dict(m.state_dict())
    md = md.double().to(x.device)
    with torch.no_grad():
        return md(x.double())


def check(label, m, x):
    f = cnn.from_model(m)
    certify.RECORD = True
    certify.last_counts = None
    with torch.no_grad():
        y = f(x)
    torch.cuda.synchronize()
    counts = certify.last_counts
    ref = reference(m, x)
    err = ((y.double() - ref).abs() / (1e-4 + 1e-4 * ref.abs()))
    nan_ok = bool((torch.isnan(y) == torch.isnan(ref)).all())
    err = torch.where(torch.isnan(ref) & torch.isnan(y.double()), torch.zeros_like(err), err)
    worst = float(err.max()) if err.numel() else 0.0
    if counts is None:
        cs = "not certified"
    else:
        c = counts[counts >= 0].float()
        cs = (f"candidates/row mean {float(c.mean()):.2f} max {int(c.max())} "
              f"guard rows {int((counts < 0).sum())}") if c.numel() else "all rows guarded"
    status = "ok" if worst <= 1.0 and nan_ok else "FAIL"
    print(f"{status:4s} {label:58s} worst err/tol {worst:.3g} nan {nan_ok}  {cs}", flush=True)
    return status == "ok"


ok = True
gelu = torch.nn.functional.gelu
cases = [
    ("98 KB 1024x8192->8192 k16 rand", 1024, 8192, 8192, 16, 2.0, gelu, "rand"),
    ("1024x8192->8192 k16 randn", 1024, 8192, 8192, 16, 2.0, gelu, "randn"),
    ("300x1000->1040 k16 randn silu", 300, 1000, 1040, 16, 1.5, torch.nn.functional.silu, "randn"),
    ("257x4096->2048 k4 rand min", 257, 4096, 2048, 4, -1.0, gelu, "rand"),
    ("1000x2048->4096 k8 randn tanh", 1000, 2048, 4096, 8, 3.0, torch.tanh, "randn"),
    ("2048x512->4096 k2 randn abs", 2048, 512, 4096, 2, 1.0, torch.abs, "randn"),
    ("700x4096->4096 k16 equal columns", 700, 4096, 4096, 16, 2.0, gelu, "equal"),
    ("600x4096->4096 k16 NaN/inf/huge rows", 600, 4096, 4096, 16, 2.0, gelu, "special"),
]
for label, B, K, N, k, scale, act, dist in cases:
    torch.manual_seed(0)
    m = PoolMax(K, N, k, scale, act).to(dev)
    if dist == "rand":
        x = torch.rand(B, K, device=dev)
    else:
        x = torch.randn(B, K, device=dev)
    if dist == "equal":   # every pooled column the same up to 1e-7: all candidates
        with torch.no_grad():
            w0 = m.lin.weight[:1].clone()
            m.lin.weight.copy_(w0 + 1e-7 * torch.randn_like(m.lin.weight))
            m.lin.bias.fill_(0.1)
    if dist == "special":
        x[3, 5] = float("nan")
        x[7, 0] = float("inf")
        x[11, :] *= 1e30
        x[13, 2] = -float("inf")
    ok &= check(label, m, x)
    del m, x
    torch.cuda.empty_cache()

# --- 98 at KernelBench's size and conditions
torch.manual_seed(0)
model = models.make_model("98", device="cuda")
x = models.get_inputs("98", device="cuda")[0]
eager = timed(lambda: model(x), opts.reps)
VARIANTS = [(True, 256, 4), (False, 256, 4), (True, 128, 8), (True, 256, 4)]


for on, th, mb in VARIANTS:
    certify.ENABLED, certify.THREADS, certify.MIN_BLOCKS = on, th, mb
    certify._kernels.clear()
    cupyfuse.clear_cache()
    f = cnn.from_model(model)
    key = f"certified, {th} threads, {mb} blocks/SM" if on else "3xTF32"
    t = timed(lambda: f(x), opts.reps)
    rows = kernel_times(lambda: f(x))
    ks = ", ".join(f"{n[:24]} {v:.1f}" for n, v in sorted(rows.items(), key=lambda kv: -kv[1]))
    print(f"  {key:36s} KB {t:.4f} ms; GPU sum {sum(rows.values()):.1f} us: {ks}", flush=True)
certify.ENABLED, certify.THREADS, certify.MIN_BLOCKS = True, 256, 4
certify._kernels.clear()
print("ALL OK" if ok else "SOME FAILED")
