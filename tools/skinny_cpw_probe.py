"""Skinny GEMM at 9-16 rows: the 16-row tile with more columns per warp (fewer x loads
per weight load: MT/CPW) or more warps, against the current policy. Cold-L2 medians in
ms, ratio to the fp32-weight floor in brackets; 'BAD' marks a result off the float64
reference. Usage: PYTHONPATH=. python tools/skinny_cpw_probe.py"""
import torch

from cupyfuse import engine, interop
from tools.skinny_probe import t_ms

# (label, variant (warps, columns per warp, unroll, min blocks, stages, staged from MT),
#  SKINNY_TILE_ROWS, SKINNY_ROW_TILES)
FORMS = [("default", None, engine.SKINNY_TILE_ROWS, engine.SKINNY_ROW_TILES),
         ("16 cpw4 st4", (4, 4, 2, 1, 4, 16), 16, 1),
         ("16 cpw8 st3", (4, 8, 2, 1, 3, 16), 16, 1),
         ("16 cpw8 st2", (4, 8, 2, 1, 2, 16), 16, 1),
         ("16 cpw6 st3", (4, 6, 2, 1, 3, 16), 16, 1),
         ("16 w8 cpw4 st3", (8, 4, 2, 1, 3, 16), 16, 1),
         ("16 w2 cpw8 st4", (2, 8, 2, 1, 4, 16), 16, 1),
         ("8x2 cpw8 st3", (4, 8, 2, 1, 3, 8), 8, 2),
         ("8x2 cpw8 unst", (4, 8, 2, 1, 0, 16), 8, 2),
         ("4x4 cpw8 unst", (4, 8, 2, 1, 0, 16), 4, 4)]


def main():
    call = interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg="")
    with call:
        print("| M | F | floor ms | " + " | ".join(f[0] for f in FORMS) + " |")
        print("|---" * (3 + len(FORMS)) + "|")
        for F in (16384, 4096):
            w = torch.randn(F, F, device="cuda") / F ** 0.5
            floor = F * F * 4 / 3.0e12 * 1e3
            for M in (8, 9, 12, 13, 16):
                x = torch.randn(M, F, device="cuda")
                ref = x.double() @ w.double().T
                scale = x.double().abs() @ w.double().abs().T
                out = torch.empty(M, F, device="cuda")
                keep = (engine.SKINNY_TILE_ROWS, engine.SKINNY_ROW_TILES)
                row = []
                for _, v, rows, tiles in FORMS:
                    engine.SKINNY_TILE_ROWS, engine.SKINNY_ROW_TILES = rows, tiles
                    try:
                        out.fill_(float("nan"))
                        engine.gemm_skinny(x, w, out, variant=v)
                        err = ((out.double() - ref).abs() / scale.clamp_min(1e-300)).max().item()
                        t = t_ms(lambda: engine.gemm_skinny(x, w, out, variant=v))
                        row.append(f"{t:.4f} ({t / floor:.2f})" +
                                   ("" if err < 2.0 ** -18 else f" BAD {err:.1e}"))
                    except Exception as e:  # a variant that cannot launch
                        row.append(f"ERR {type(e).__name__}: {str(e)[:60]}")
                engine.SKINNY_TILE_ROWS, engine.SKINNY_ROW_TILES = keep
                print(f"| {M} | {F} | {floor:.4f} | " + " | ".join(row) + " |", flush=True)
            del w


if __name__ == "__main__":
    main()
