"""Which float32 GEMM path is fastest for our shapes (TF32 off), and split-K for 98.

Prints median ms (do_bench) for cupy.cublas.gemm, torch.mm and split-K torch.bmm.
"""
import cupy
import cupy.cublas
import torch
from triton.testing import do_bench

from cupyfuse.interop import cupy_view

torch.backends.cuda.matmul.allow_tf32 = False
shapes = {"55 pairdiff": (128, 16388, 32768), "55 pairdiff unpadded": (128, 16385, 32768),
          "56/55 full": (128, 32768, 32768), "98 fold": (1024, 512, 8192),
          "39 kb": (16384, 4096, 4096), "39 seed": (1024, 8192, 8192)}
for name, (M, N, K) in shapes.items():
    x = torch.rand(M, K, device="cuda")
    w = torch.rand(N, K, device="cuda") - 0.5
    z = torch.empty(M, N, device="cuda")
    xc, wc, zc = cupy_view(x), cupy_view(w), cupy_view(z)
    s = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    def f_cupy():
        with s:
            cupy.cublas.gemm("N", "T", xc, wc, out=zc)
    t_cupy = do_bench(f_cupy, warmup=50, rep=300, return_mode="median")
    t_torch = do_bench(lambda: torch.mm(x, w.T, out=z), warmup=50, rep=300, return_mode="median")
    line = f"{name:22s} M={M:6d} N={N:6d} K={K:6d}  cupy {t_cupy:8.4f} ms  torch.mm {t_torch:8.4f} ms"
    if name.startswith("98") or name.startswith("39 seed"):
        for sk in (2, 4, 8):
            xs = x.view(M, sk, K // sk).transpose(0, 1)
            ws = w.view(N, sk, K // sk).transpose(0, 1)
            out = torch.empty(sk, M, N, device="cuda")
            t = do_bench(lambda: torch.bmm(xs, ws.transpose(1, 2), out=out), warmup=50, rep=300,
                         return_mode="median")
            line += f"  splitK{sk} {t:7.4f}"
    print(line, flush=True)
    del x, w, z
    torch.cuda.empty_cache()

# 56 end to end, alternating eager and cupyfuse to see run-to-run spread (clocks, heat)
from cupyfuse import models
from cupyfuse import nn as cnn

torch.manual_seed(0)
model = models.make_model("56", "kernelbench", device="cuda")
fused = cnn.from_model(model)
x = torch.rand(128, 32768, device="cuda")
with torch.no_grad():
    for r in range(3):
        te = do_bench(lambda: model(x), warmup=100, rep=500, return_mode="median")
        tf = do_bench(lambda: fused(x), warmup=100, rep=500, return_mode="median")
        print(f"56 round {r}: eager {te:.4f} ms  cupyfuse {tf:.4f} ms  ratio {te / tf:.3f}", flush=True)
