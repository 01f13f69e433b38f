"""Skinny GEMM at 9-16 rows: the lane-column form (gemm_skinny.cuh's skinny_tile_lanes:
each lane owns columns, x read as warp-uniform float4s) against the default policy.
Cold-L2 medians in ms, ratio to the fp32-weight floor in brackets; 'BAD' marks a result
off the float64 reference. Usage: PYTHONPATH=. python tools/skinny_lanes_probe.py"""
import sys

import cupy
import torch

from cupyfuse import engine, interop
from cupyfuse.runtime import get_function, launch
from tools.skinny_probe import t_ms

# (warps, columns per lane, K steps of 8 in flight, min blocks per SM, rows per tile)
FORMS = [(4, 1, 1, 4, 16), (4, 1, 2, 3, 16), (4, 2, 1, 3, 16), (4, 2, 1, 2, 16),
         (4, 1, 2, 2, 16), (8, 1, 1, 2, 16), (4, 2, 2, 2, 16), (4, 1, 2, 4, 8),
         (4, 2, 1, 4, 8)]
if len(sys.argv) > 1:
    FORMS = [tuple(int(v) for v in f.split(",")) for f in sys.argv[1:]]


def lanes(x, w, out, form):
    warps, cpl, unroll, minb, mt = form
    M, K = x.shape
    N = w.shape[0]
    sm = engine._device(x)[1]
    pl = engine.skinny_plan(M, N, K, sm, warps * 32 * cpl, 32 * warps)
    rtiles = -(-M // mt)
    ctiles = -(-N // (warps * 32 * cpl))
    splits = max(1, min(-(-4 * sm // (ctiles * rtiles)), K // 512, 64))
    kspan = -(-(-(-K // splits)) // 128) * 128
    splits = -(-K // kspan)
    part = cnt = 0
    if splits > 1:
        part, cnt = engine._skinny_workspace(x.device.index, cupy.cuda.get_current_stream().ptr,
                                             splits * M * N, ctiles * rtiles)
    opts = (f"-DSK_WARPS={warps}", f"-DSK_CPL={cpl}", f"-DSK_LUNROLL={unroll}",
            f"-DSK_MINB={minb}")
    del pl
    launch(get_function("gemm_skinny.cu", f"gemm_skinny_lanes_{mt}", x.device.index, opts),
           (ctiles * rtiles, splits), 32 * warps,
           (x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), M, N, K, kspan,
            out.data_ptr(), out.stride(0), part, cnt, 1))
    return out


def main():
    call = interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg="")
    with call:
        labels = ["default"] + ["w%d cpl%d u%d b%d mt%d" % f for f in FORMS]
        print("| M | F | floor ms | " + " | ".join(labels) + " |")
        print("|---" * (3 + len(labels)) + "|")
        for F in (16384, 4096):
            w = torch.randn(F, F, device="cuda") / F ** 0.5
            floor = F * F * 4 / 3.0e12 * 1e3
            for M in (1, 8, 9, 12, 13, 16):
                x = torch.randn(M, F, device="cuda")
                ref = x.double() @ w.double().T
                scale = x.double().abs() @ w.double().abs().T
                out = torch.empty(M, F, device="cuda")
                row = []
                runs = [lambda: engine.gemm_skinny(x, w, out)] + \
                    [(lambda f=f: lanes(x, w, out, f)) for f in FORMS]
                for fn in runs:
                    try:
                        out.fill_(float("nan"))
                        fn()
                        err = ((out.double() - ref).abs() / scale.clamp_min(1e-300)).max().item()
                        t = t_ms(fn)
                        row.append(f"{t:.4f} ({t / floor:.2f})" +
                                   ("" if err < 2.0 ** -18 else f" BAD {err:.1e}"))
                    except Exception as e:  # a variant that cannot launch
                        row.append(f"ERR {type(e).__name__}: {str(e)[:60]}")
                print(f"| {M} | {F} | {floor:.4f} | " + " | ".join(row) + " |", flush=True)
            del w


if __name__ == "__main__":
    main()
