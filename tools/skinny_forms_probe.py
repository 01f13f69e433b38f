"""Skinny GEMM at 1-32 rows: one tall row tile (up to 16 rows of accumulators) against short
row tiles side by side in launch order (engine.SKINNY_TILE_ROWS / SKINNY_ROW_TILES; the
later tiles' weight rows come from L2), with the kernel's tuning knobs (warps, columns
per warp, unroll, min blocks), and the big engine. Cold-L2 medians in ms, ratio to the
fp32-weight floor in brackets; 'BAD' marks a result off the float64 reference.
(16-row tiles now run the wgmma form, gemm_skinny_16wg: tools/skinny_wg_probe.py
measures it; the cp.async-staged FMA forms measured here before left the tree,
docs/ENGINE_NOTES.md v15, v25 and v29.)
Usage: PYTHONPATH=. python tools/skinny_forms_probe.py"""
import torch

from cupyfuse import engine, gemm, interop
from tools.skinny_probe import t_ms

# (label, variant, SKINNY_TILE_ROWS, SKINNY_ROW_TILES)
FORMS = [("one tile", None, 16, 1), ("4-row tiles", None, 4, 16),
         ("8-row tiles", None, 8, 16),
         ("default", None, engine.SKINNY_TILE_ROWS, engine.SKINNY_ROW_TILES)]


def main():
    call = interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg="")
    with call:
        print("| M | F | floor ms | cuBLAS | engine | " + " | ".join(f[0] for f in FORMS) + " |")
        print("|---" * (5 + len(FORMS)) + "|")
        for F in (4096, 16384):
            w = torch.randn(F, F, device="cuda") / F ** 0.5
            floor = F * F * 4 / 3.0e12 * 1e3
            for M in (1, 4, 8, 12, 13, 16, 32):
                x = torch.randn(M, F, device="cuda")
                ref = x.double() @ w.double().T
                scale = x.double().abs() @ w.double().abs().T
                out = torch.empty(M, F, device="cuda")
                cb = t_ms(lambda: torch.mm(x, w.t(), out=out))
                old = (gemm.SKINNY_MAX_M, gemm.SKINNY_SMALL_MAX_M)
                gemm.SKINNY_MAX_M = gemm.SKINNY_SMALL_MAX_M = 0
                en = t_ms(lambda: gemm.linear_nobias(x, w, out, precision="highest", owner=w))
                gemm.SKINNY_MAX_M, gemm.SKINNY_SMALL_MAX_M = old
                keep = (engine.SKINNY_TILE_ROWS, engine.SKINNY_ROW_TILES)
                row = []
                for _, v, rows, tiles in FORMS:
                    engine.SKINNY_TILE_ROWS, engine.SKINNY_ROW_TILES = rows, tiles
                    out.fill_(float("nan"))
                    engine.gemm_skinny(x, w, out, variant=v)
                    err = ((out.double() - ref).abs() / scale.clamp_min(1e-300)).max().item()
                    t = t_ms(lambda: engine.gemm_skinny(x, w, out, variant=v))
                    row.append(f"{t:.4f} ({t / floor:.2f})" + ("" if err < 2.0 ** -18 else f" BAD {err:.1e}"))
                engine.SKINNY_TILE_ROWS, engine.SKINNY_ROW_TILES = keep
                print(f"| {M} | {F} | {floor:.4f} | {cb:.4f} | {en:.4f} | " + " | ".join(row) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
