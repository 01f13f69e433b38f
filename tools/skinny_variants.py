"""gemm_skinny tuning knobs (warps, columns per warp, unroll, min blocks) at skinny shapes:
cold-L2 medians in ms, against the fp32-weight floor. PYTHONPATH=. python tools/skinny_variants.py"""
import torch

from cupyfuse import engine, interop
from tools.skinny_probe import t_ms

VARIANTS = [(8, 4, 2, 1), (8, 4, 1, 1), (4, 4, 2, 1), (8, 2, 2, 1), (16, 2, 1, 1), (8, 2, 1, 2),
            (4, 8, 1, 1)]
call = interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg="")
with call:
    print("| M | F | floor | " + " | ".join(str(v) for v in VARIANTS) + " |")
    for F in (4096, 16384):
        w = torch.randn(F, F, device="cuda") / F ** 0.5
        for M in (1, 8, 16, 32):
            x = torch.randn(M, F, device="cuda")
            ref = x.double() @ w.double().T
            out = torch.empty(M, F, device="cuda")
            row = []
            for v in VARIANTS:
                engine.gemm_skinny(x, w, out, variant=v)
                err = (out.double() - ref).abs().max().item()
                row.append(f"{t_ms(lambda: engine.gemm_skinny(x, w, out, variant=v)):.4f}"
                           + ("" if err < 1e-3 else " BAD"))
            print(f"| {M} | {F} | {F * F * 4 / 3e9:.4f} | " + " | ".join(row) + " |", flush=True)
