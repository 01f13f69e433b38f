"""The 16-row skinny tile on the tensor cores (gemm_skinny_16tc: 3xTF32 on mma.sync, the
weight split in registers) in its tuning forms, against the engine's skinny plan (the
FMA tiles below 13 rows, this tile's default form from 13) and cuBLAS, cold-L2 medians in ms,
ratio to the fp32-weight floor in brackets. Accuracy: max |err| / (|x| @ |w|) against
float64 on randn and all-positive data ('BAD' past 2^-18), and the non-finite pattern of
inf/NaN operands against fp32 torch.mm.
Usage: PYTHONPATH=.:tools python tools/skinny_tc_probe.py [--grid | --vs-fma OLD_KERNELS_DIR]"""
import torch

from cupyfuse import engine, interop
from cupyfuse.runtime import get_function, launch
from skinny_probe import t_ms

# (label, SKT_WARPS, K splits: "waves" (engine.skinny_plan's whole waves of resident
# blocks) or blocks per SM aimed at, shortest K span, compile options)
FORMS = [("tc (default)", 8, "waves", 512, ()), ("tc p4", 8, 4, 512, ()),
         ("4 warps a2, waves", 4, "waves", 512, ("-DSKT_WARPS=4", "-DSKT_MINB=1", "-DSKT_AHEAD=2")),
         ("4 warps a2 p4", 4, 4, 512, ("-DSKT_WARPS=4", "-DSKT_MINB=1", "-DSKT_AHEAD=2"))]


def tc(x, w, out, warps, per_sm, min_kspan, opts=(), sm=132):
    """gemm_skinny_16tc compiled with ``opts`` (SKT_WARPS = ``warps``), K split by
    ``per_sm``: "waves" (2 resident blocks of 8 warps per SM, 3 of 4 warps) or a target of
    blocks per SM (the FMA tiles' rule)."""
    M, K = x.shape
    N = w.shape[0]
    cols = warps * 8 * engine._SKINNY_TC_NG
    ctiles, rtiles = -(-N // cols), -(-M // 16)
    smax = max(1, min(K // min_kspan, 64))
    if per_sm == "waves":
        splits = engine._whole_waves(ctiles * rtiles, smax, (2 if warps == 8 else 3) * sm)
    else:
        splits = max(1, min(-(-per_sm * sm // (ctiles * rtiles)), smax))
    kspan = -(-K // splits)
    kspan = -(-kspan // 128) * 128
    splits = -(-K // kspan)
    part = cnt = 0
    if splits > 1:
        import cupy
        part, cnt = engine._skinny_workspace(x.device.index, cupy.cuda.get_current_stream().ptr,
                                             splits * M * N, ctiles * rtiles)
    vec = int(K % 4 == 0 and x.stride(0) % 4 == 0 and w.stride(0) % 4 == 0
              and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)
    fn = get_function("gemm_skinny.cu", "gemm_skinny_16tc", x.device.index, opts)
    launch(fn, (ctiles * rtiles, splits), 32 * warps,
           (x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), M, N, K, kspan,
            out.data_ptr(), out.stride(0), part, cnt, vec))
    return out


def rel_err(out, x, w):
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    return ((out.double() - ref).abs() / scale.clamp_min(1e-300)).max().item()


GRID = FORMS


def time_forms(x, w, out, floor, forms):
    """Each form's cold-L2 median ms (ratio to ``floor``; 'BAD' past 2^-18 of the row scale)."""
    cells = []
    for f in forms:
        tc(x, w, out, *f[1:])
        bad = rel_err(out, x, w) >= 2.0 ** -18
        t = t_ms(lambda: tc(x, w, out, *f[1:]))
        cells.append(f"{t:.4f} ({t / floor:.2f})" + (" BAD" if bad else ""))
    return cells


def grid_main():
    """16 rows over weight shapes, the tile's forms and grids."""
    print("| M | N | K | floor ms | engine.gemm_skinny | " + " | ".join(f[0] for f in GRID) + " |")
    print("|---" * (5 + len(GRID)) + "|")
    for N, K in ((4096, 4096), (8192, 8192), (16384, 16384), (4096, 16384), (16384, 4096),
                 (2048, 4096), (28672, 4096)):
        w = torch.randn(N, K, device="cuda") / K ** 0.5
        floor = N * K * 4 / 3.0e12 * 1e3
        for M in (13, 16):
            x = torch.randn(M, K, device="cuda")
            out = torch.empty(M, N, device="cuda")
            t0 = t_ms(lambda: engine.gemm_skinny(x, w, out))
            row = [f"{t0:.4f} ({t0 / floor:.2f})"] + time_forms(x, w, out, floor, GRID)
            print(f"| {M} | {N} | {K} | {floor:.4f} | " + " | ".join(row) + " |", flush=True)


def vs_fma_main(old_dir):
    """13 and 16 rows over weight shapes: the engine's plan (the tensor-core tile) against
    the FMA 16-row tile of an older kernels_cu (``old_dir``: its gemm_skinny.cu/.cuh, e.g.
    from `git show 45a4855:kernels_cu/gemm_skinny.cu`), launched with the plan of its day
    (16 columns per block of 4 warps, K split to about 4 blocks per SM)."""
    from pathlib import Path

    import cupy

    from cupyfuse import runtime

    text = runtime.expand_source("gemm_skinny.cu", root=Path(old_dir))
    opts = runtime._DEFAULT_OPTIONS + (f"-arch={runtime.arch_for_device(0)}",)
    raw = cupy.RawModule(code=text, options=opts).get_function("gemm_skinny_16")
    old = runtime.Kernel(raw, "gemm_skinny_16", runtime.kernel_formats(text)["gemm_skinny_16"])

    def fma16(x, w, out, sm=132):
        M, K = x.shape
        N = w.shape[0]
        ctiles, rtiles = -(-N // 16), -(-M // 16)
        splits = max(1, min(-(-4 * sm // (ctiles * rtiles)), K // engine.SKINNY_MIN_KSPAN, 64))
        kspan = -(-(-(-K // splits)) // 128) * 128
        splits = -(-K // kspan)
        part = cnt = 0
        if splits > 1:
            part, cnt = engine._skinny_workspace(0, cupy.cuda.get_current_stream().ptr,
                                                 splits * M * N, ctiles * rtiles)
        launch(old, (ctiles * rtiles, splits), 128,
               (x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), M, N, K, kspan,
                out.data_ptr(), out.stride(0), part, cnt, 1))

    print("| M | N | K | floor ms | FMA 16-row tile (old) | engine (tensor cores) | "
          + " | ".join(f[0] for f in FORMS[1:]) + " |")
    print("|---" * (6 + len(FORMS) - 1) + "|")
    for N, K in ((2048, 4096), (4096, 2048), (3000, 3000), (4096, 4096), (1024, 16384),
                 (16384, 1024), (6144, 6144), (8192, 8192), (12288, 12288), (16384, 16384),
                 (32768, 8192), (12288, 4096), (20480, 8192), (10240, 10240)):
        w = torch.randn(N, K, device="cuda") / K ** 0.5
        floor = N * K * 4 / 3.0e12 * 1e3
        for M in (13, 16):
            x = torch.randn(M, K, device="cuda")
            out = torch.empty(M, N, device="cuda")
            fma16(x, w, out)
            e0 = rel_err(out, x, w)
            t0 = t_ms(lambda: fma16(x, w, out))
            engine.gemm_skinny(x, w, out)
            e1 = rel_err(out, x, w)
            t1 = t_ms(lambda: engine.gemm_skinny(x, w, out))
            more = time_forms(x, w, out, floor, FORMS[1:])
            print(f"| {M} | {N} | {K} | {floor:.4f} | {t0:.4f} ({t0 / floor:.2f}, err {e0:.1e}) | "
                  f"{t1:.4f} ({t1 / floor:.2f}, err {e1:.1e}) | " + " | ".join(more) + " |",
                  flush=True)


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    call = interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg="")
    with call:
        # accuracy and non-finite behaviour first (odd sizes, both load paths)
        print("accuracy (max err / row scale; FMA tile in brackets):")
        for M, N, K in ((16, 1000, 4100), (13, 4096, 16384), (16, 333, 1001), (9, 17, 40)):
            for dist in ("randn", "rand"):
                g = torch.Generator(device="cuda").manual_seed(M + N + K)
                mk = (lambda *s: torch.randn(*s, device="cuda", generator=g)) if dist == "randn" \
                    else (lambda *s: torch.rand(*s, device="cuda", generator=g))
                x, w = mk(M, K), mk(N, K) / K ** 0.5
                for k, lab, xx in ((0, "vec", x), (2, "vec 4 warps", x), (2, "strided", torch.empty(M, K + 1, device="cuda")[:, 1:].copy_(x))):
                    out = torch.full((M, N), float("nan"), device="cuda")
                    tc(xx, w, out, *FORMS[k][1:])
                    ref_out = torch.empty(M, N, device="cuda")
                    engine.gemm_skinny(xx, w, ref_out)
                    e1, e0 = rel_err(out, x, w), rel_err(ref_out, x, w)
                    flag = "" if e1 < 2.0 ** -18 else " BAD"
                    print(f"  {M}x{N}x{K} {dist} {lab}: {e1:.2e} ({e0:.2e}){flag}")
        x = torch.randn(16, 4096, device="cuda")
        w = torch.randn(1000, 4096, device="cuda") / 64
        x[3, 7] = float("inf")
        x[5, 100] = float("nan")
        w[11, 9] = float("-inf")
        w[12, 13] = float("nan")
        x[7] = 0.0
        w[20, 30] = 3e38
        x[8, 30] = 10.0
        out = torch.empty(16, 1000, device="cuda")
        tc(x, w, out, *FORMS[0][1:])
        ref = torch.mm(x, w.t())
        same_nan = torch.equal(torch.isnan(out), torch.isnan(ref))
        same_inf = torch.equal(torch.isinf(out), torch.isinf(ref)) and torch.equal(
            out[torch.isinf(out)], ref[torch.isinf(ref)])
        fin = torch.isfinite(ref)
        e = ((out - ref).abs()[fin] / (x.abs() @ w.abs().t())[fin].clamp_min(1e-30)).max().item()
        print(f"non-finite: NaN pattern {'same' if same_nan else 'DIFFERENT'}, inf pattern "
              f"{'same' if same_inf else 'DIFFERENT'}, finite err {e:.2e}")

        print("\n| M | F | floor ms | cuBLAS fp32 | engine.gemm_skinny | " + " | ".join(f[0] for f in FORMS) + " |")
        print("|---" * (5 + len(FORMS)) + "|")
        for F in (16384, 4096):
            w = torch.randn(F, F, device="cuda") / F ** 0.5
            floor = F * F * 4 / 3.0e12 * 1e3
            for M in (1, 8, 12, 13, 16):
                x = torch.randn(M, F, device="cuda")
                out = torch.empty(M, F, device="cuda")
                cb = t_ms(lambda: torch.mm(x, w.t(), out=out))
                t0 = t_ms(lambda: engine.gemm_skinny(x, w, out))
                row = [f"{cb:.4f} ({cb / floor:.2f})", f"{t0:.4f} ({t0 / floor:.2f})"]
                row += time_forms(x, w, out, floor, FORMS)
                print(f"| {M} | {F} | {floor:.4f} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    import sys

    torch.backends.cuda.matmul.allow_tf32 = False
    if "--vs-fma" in sys.argv:
        with interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg=""):
            vs_fma_main(sys.argv[sys.argv.index("--vs-fma") + 1])
    elif "--grid" in sys.argv:
        with interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg=""):
            grid_main()
    else:
        main()
