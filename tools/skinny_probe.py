"""Skinny-batch GEMM on the GPU: gemm_skinny vs the tensor-core engine vs cuBLAS fp32, cold
L2 (flushed before each call), median of CUDA-event times; then the fp32-weight floor.
Usage: PYTHONPATH=. python tools/skinny_probe.py"""
import torch

from cupyfuse import engine, gemm, interop
from cupyfuse.bench_sweep import _timer

torch.backends.cuda.matmul.allow_tf32 = False
_gpu_time = _timer(torch.device("cuda"))   # bench --sweep's cold-L2 median timer


def t_ms(fn, reps=30):
    """Cold-L2 median ms of ``fn`` (the pair timer's first side; its second is a no-op)."""
    return _gpu_time(fn, _noop, reps)[0]


def _noop():
    pass


def main():
    call = interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg="")
    with call:
        print("| M | N = K | floor ms | skinny | engine | cuBLAS fp32 | skinny/floor |")
        print("|---|---|---|---|---|---|---|")
        for F in (1024, 4096, 16384):
            w = torch.randn(F, F, device="cuda") / F ** 0.5
            for M in (1, 4, 8, 16, 32, 64, 128):
                x = torch.randn(M, F, device="cuda")
                out = torch.empty(M, F, device="cuda")
                floor = F * F * 4 / 3.0e12 * 1e3
                sk = t_ms(lambda: engine.gemm_skinny(x, w, out))
                old = (gemm.SKINNY_MAX_M, gemm.SKINNY_SMALL_MAX_M)
                gemm.SKINNY_MAX_M = gemm.SKINNY_SMALL_MAX_M = 0
                en = t_ms(lambda: gemm.linear_nobias(x, w, out, precision="highest", owner=w))
                gemm.SKINNY_MAX_M, gemm.SKINNY_SMALL_MAX_M = old
                cb = t_ms(lambda: torch.mm(x, w.t(), out=out))
                print(f"| {M} | {F} | {floor:.4f} | {sk:.4f} | {en:.4f} | {cb:.4f} | {sk / floor:.2f} |",
                      flush=True)
            del w


if __name__ == "__main__":
    main()
