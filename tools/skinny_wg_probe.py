"""The 16-row skinny tile on wgmma (gemm_skinny_16wg: the weight as the m64 operand from
registers, x's rows as the n16 operand from shared memory) in its tuning forms, against
the engine's skinny plan (FMA tiles up to 8 rows, this tile from 9) and cuBLAS:
cold-L2 medians in ms, ratio to the fp32-weight floor (3.0 TB/s) in brackets. Accuracy
first: max |err| / (|x| @ |w|) against float64 ('BAD' past 2^-18), odd sizes, both load
paths, and the non-finite pattern of inf/NaN operands against fp32 torch.mm.
Usage: PYTHONPATH=.:tools python tools/skinny_wg_probe.py [--quick]"""
import sys

import torch

from cupyfuse import engine, interop
from cupyfuse.runtime import get_function, launch
from skinny_probe import t_ms

# (label, SKW_WG, SKW_MINB, more compile options)
# (label, SKW_WG, SKW_MINB, more compile options); the first is the engine's form
FORMS = [("wg", 2, 2, ()), ("wg a2", 2, 2, ("-DSKW_AHEAD=2",)), ("wg x1 b4", 1, 4, ()),
         ("wg x4 b1", 4, 1, ()), ("wg x4 b1 kc256", 4, 1, ("-DSKW_KC=256",))]
CHECKED = 5
# the engine's FMA tiles with other compile options (--fma; e.g. SK_WARPS, SK_UNROLL)
FORMS_FMA = [("fma 8 warps", "fma", 0, ("-DSK_WARPS=8",))]   # the forms past these give wrong results on purpose


def wg(x, w, out, wgs, minb, more=(), sm=132):
    if wgs == "fma":   # the engine's FMA tiles (rows <= 8) compiled with ``more``
        M, K = x.shape
        N = w.shape[0]
        pl = engine.skinny_plan(M, N, K, sm)
        part = cnt = 0
        if pl.splits > 1:
            import cupy
            part, cnt = engine._skinny_workspace(x.device.index, cupy.cuda.get_current_stream().ptr,
                                                 pl.splits * M * N, pl.ctiles * pl.rtiles)
        vec = int(K % 4 == 0 and x.stride(0) % 4 == 0 and w.stride(0) % 4 == 0
                  and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)
        launch(get_function("gemm_skinny.cu", pl.fn, x.device.index, tuple(more)), pl.grid, pl.threads,
               (x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), M, N, K, pl.kspan,
                out.data_ptr(), out.stride(0), part, cnt, vec))
        return out
    M, K = x.shape
    N = w.shape[0]
    cols = 64 * wgs
    ctiles, rtiles = -(-N // cols), -(-M // 16)
    smax = max(1, min(K // engine.SKINNY_MIN_KSPAN, 64))
    splits = engine._whole_waves(ctiles * rtiles, smax, minb * sm)
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
    opts = (f"-DSKW_WG={wgs}", f"-DSKW_MINB={minb}") + tuple(more)
    fn = get_function("gemm_skinny.cu", "gemm_skinny_16wg", x.device.index, opts)
    launch(fn, (ctiles * rtiles, splits), 128 * wgs,
           (x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), M, N, K, kspan,
            out.data_ptr(), out.stride(0), part, cnt, vec))
    return out


def rel_err(out, x, w):
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    return ((out.double() - ref).abs() / scale.clamp_min(1e-300)).max().item()


def accuracy():
    print("accuracy (max err / row scale; engine plan in brackets):")
    bad = 0
    for M, N, K in ((16, 1000, 4100), (13, 4096, 16384), (16, 333, 1001), (9, 17, 40),
                    (12, 130, 129), (16, 64, 8), (32, 200, 700), (5, 1, 3)):
        for dist in ("randn", "rand"):
            g = torch.Generator(device="cuda").manual_seed(M + N + K)
            mk = (lambda *s: torch.randn(*s, device="cuda", generator=g)) if dist == "randn" \
                else (lambda *s: torch.rand(*s, device="cuda", generator=g))
            x, w = mk(M, K), mk(N, K) / K ** 0.5
            xs = torch.empty(M, K + 1, device="cuda")[:, 1:].copy_(x)
            for f in FORMS[:CHECKED]:
                for lab, xx in (("vec", x), ("strided", xs)):
                    out = torch.full((M, N), float("nan"), device="cuda")
                    wg(xx, w, out, *f[1:])
                    ref_out = torch.empty(M, N, device="cuda")
                    engine.gemm_skinny(xx, w, ref_out)
                    e1, e0 = rel_err(out, x, w), rel_err(ref_out, x, w)
                    flag = "" if e1 < 2.0 ** -18 else " BAD"
                    bad += bool(flag)
                    print(f"  {M}x{N}x{K} {dist} {f[0]} {lab}: {e1:.2e} ({e0:.2e}){flag}")
    x = torch.randn(16, 4096, device="cuda")
    w = torch.randn(1000, 4096, device="cuda") / 64
    x[3, 7] = float("inf")
    x[5, 100] = float("nan")
    w[11, 9] = float("-inf")
    w[12, 13] = float("nan")
    x[7] = 0.0
    w[20, 30] = 3e38
    x[8, 30] = 10.0
    x[9, 5] = 3.4e38
    for f in FORMS[:CHECKED]:
        out = torch.empty(16, 1000, device="cuda")
        wg(x, w, out, *f[1:])
        ref = torch.mm(x, w.t())
        same_nan = torch.equal(torch.isnan(out), torch.isnan(ref))
        same_inf = torch.equal(torch.isinf(out), torch.isinf(ref)) and torch.equal(
            out[torch.isinf(out)], ref[torch.isinf(ref)])
        fin = torch.isfinite(ref) & torch.isfinite(out)
        e = ((out - ref).abs()[fin] / (x.abs() @ w.abs().t())[fin].clamp_min(1e-30)).max().item()
        bad += not (same_nan and same_inf)
        tcout = torch.empty(16, 1000, device="cuda")
        engine.gemm_skinny(x, w, tcout)
        diff = (torch.isnan(out) != torch.isnan(ref)) | (torch.isinf(out) != torch.isinf(ref))
        for r, c in diff.nonzero().tolist()[:8]:
            print(f"   ({r}, {c}): wg {out[r, c].item():.4g}, torch.mm {ref[r, c].item():.4g}, "
                  f"engine {tcout[r, c].item():.4g}, f64 {(x[r].double() @ w[c].double()).item():.4g}")
        print(f"non-finite {f[0]}: NaN pattern {'same' if same_nan else 'DIFFERENT'}, inf pattern "
              f"{'same' if same_inf else 'DIFFERENT'}, finite err {e:.2e}")
    # run-to-run bitwise (split-K combine in fixed order)
    x = torch.randn(16, 16384, device="cuda")
    w = torch.randn(4096, 16384, device="cuda")
    a, b = torch.empty(16, 4096, device="cuda"), torch.empty(16, 4096, device="cuda")
    wg(x, w, a, *FORMS[0][1:])
    wg(x, w, b, *FORMS[0][1:])
    print("bitwise run to run:", torch.equal(a, b))
    print("BAD cells:", bad, flush=True)


def timing(shapes, rows):
    print("\n| M | N | K | floor ms | cuBLAS fp32 | engine plan | " + " | ".join(f[0] for f in FORMS) + " |")
    print("|---" * (6 + len(FORMS)) + "|")
    for N, K in shapes:
        w = torch.randn(N, K, device="cuda") / K ** 0.5
        floor = N * K * 4 / 3.0e12 * 1e3
        for M in rows:
            x = torch.randn(M, K, device="cuda")
            out = torch.empty(M, N, device="cuda")
            cb = t_ms(lambda: torch.mm(x, w.t(), out=out))
            t0 = t_ms(lambda: engine.gemm_skinny(x, w, out))
            row = [f"{cb:.4f} ({cb / floor:.2f})", f"{t0:.4f} ({t0 / floor:.2f})"]
            for f in FORMS:
                wg(x, w, out, *f[1:])
                bad = rel_err(out, x, w) >= 2.0 ** -18 and FORMS.index(f) < CHECKED
                t = t_ms(lambda: wg(x, w, out, *f[1:]))
                row.append(f"{t:.4f} ({t / floor:.2f})" + (" BAD" if bad else ""))
            print(f"| {M} | {N} | {K} | {floor:.4f} | " + " | ".join(row) + " |", flush=True)
        del w


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    with interop.Call.begin("probe", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg=""):
        accuracy()
        if "--fma" in sys.argv:   # the FMA tiles (compile options in FORMS_FMA)
            FORMS[:] = FORMS_FMA
            timing(((16384, 16384), (32768, 8192), (12288, 12288), (8192, 8192), (4096, 4096)),
                   (1, 2, 4, 6, 8))
        elif "--quick" in sys.argv:
            timing(((16384, 16384), (32768, 8192), (8192, 8192), (4096, 4096)), (9, 16))
        else:
            timing(((16384, 16384), (4096, 4096), (8192, 8192), (12288, 12288), (32768, 8192),
                    (16384, 4096), (4096, 16384), (16384, 1024), (2048, 4096)), (8, 9, 12, 13, 16))
