"""Probe of the sm90 engine (kernels_cu/gemm_sm90.cu): correctness vs float64 and cuBLAS,
then speed. Prints one line per (shape, variant); run under `timeout` (a wrong barrier
protocol would hang)."""
import sys

import torch

from cupyfuse import engine
from cupyfuse.interop import _external_stream

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda")
import cupy  # noqa: E402

cupy.cuda.Device(0).use()
stream_ctx = _external_stream(torch.cuda.current_stream().cuda_stream, 0)
stream_ctx.__enter__()


def ours(a, b, passes, splits=None):
    out = torch.full((a.shape[0], b.shape[0]), float("nan"), device=dev)
    if passes == 3:
        ab, as_ = torch.empty_like(a), torch.empty_like(a)
        bb, bs = torch.empty_like(b), torch.empty_like(b)
        engine.split_tf32(a, ab, as_)
        engine.split_tf32(b, bb, bs)
        engine.gemm(ab, bb, out, passes=3, a_small=as_, b_small=bs, splits=splits)
    else:
        engine.gemm(a, b, out, passes=1, splits=splits)
    return out


def err(out, ref):
    d = (out.double() - ref).abs()
    return (d.max() / ref.abs().max()).item(), (d.norm() / ref.norm()).item()


shapes = [(64, 64, 32), (200, 136, 100), (77, 131, 260), (128, 512, 8192), (1024, 512, 8192),
          (1000, 1000, 1000), (8192, 8192, 8192), (128, 16388, 32768), (16384, 4096, 4096)]
if len(sys.argv) > 1:
    shapes = shapes[: int(sys.argv[1])]
for (M, N, K) in shapes:
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    a = torch.randn(M, K, device=dev, generator=g)
    b = torch.randn(N, K, device=dev, generator=g)
    ref = a.double() @ b.double().T
    sg = a @ b.T
    e_sg = err(sg, ref)
    o3 = ours(a, b, 3)
    torch.cuda.synchronize()
    e3 = err(o3, ref)
    o1 = ours(a, b, 1)
    torch.cuda.synchronize()
    e1 = err(o1, ref)
    nan3 = int(torch.isnan(o3).sum())
    print(f"{M:6d}x{N:6d}x{K:6d}  maxrel/frorel  sgemm {e_sg[0]:.2e}/{e_sg[1]:.2e}  "
          f"3xtf32 {e3[0]:.2e}/{e3[1]:.2e} (nan {nan3})  1xtf32 {e1[0]:.2e}/{e1[1]:.2e}", flush=True)
    del ref, sg, o3, o1
    torch.cuda.empty_cache()

from triton.testing import do_bench  # noqa: E402

for (M, N, K) in [(8192, 8192, 8192), (16384, 4096, 4096), (128, 16388, 32768), (1024, 512, 8192),
                  (128, 32768, 32768)]:
    if len(sys.argv) > 1:
        break
    a = torch.randn(M, K, device=dev)
    b = torch.randn(N, K, device=dev)
    ab, as_ = torch.empty_like(a), torch.empty_like(a)
    bb, bs = torch.empty_like(b), torch.empty_like(b)
    engine.split_tf32(a, ab, as_)
    engine.split_tf32(b, bb, bs)
    out = torch.empty(M, N, device=dev)
    bmaps = (engine.encode_tensor_map(bb), engine.encode_tensor_map(bs))
    flop = 2 * M * N * K
    t3 = do_bench(lambda: engine.gemm(ab, bb, out, passes=3, a_small=as_, b_small=bs, b_maps=bmaps),
                  warmup=25, rep=200, return_mode="median")
    t3s = do_bench(lambda: engine.split_tf32(a, ab, as_), warmup=25, rep=200, return_mode="median")
    t1 = do_bench(lambda: engine.gemm(a, b, out, passes=1), warmup=25, rep=200, return_mode="median")
    tsg = do_bench(lambda: torch.mm(a, b.T, out=out), warmup=25, rep=200, return_mode="median")
    torch.backends.cuda.matmul.allow_tf32 = True
    ttf = do_bench(lambda: torch.mm(a, b.T, out=out), warmup=25, rep=200, return_mode="median")
    torch.backends.cuda.matmul.allow_tf32 = False
    tf = lambda t: flop / t / 1e9  # noqa: E731
    print(f"{M:6d}x{N:6d}x{K:6d}  ms(TFLOP/s): 3xtf32 {t3:.3f} ({tf(t3):.0f}) +split(x) {t3s:.3f}  "
          f"1xtf32 {t1:.3f} ({tf(t1):.0f})  cuBLAS fp32 {tsg:.3f} ({tf(tsg):.0f})  "
          f"cuBLAS tf32 {ttf:.3f} ({tf(ttf):.0f})", flush=True)
    del a, b, ab, as_, bb, bs, out
    torch.cuda.empty_cache()
