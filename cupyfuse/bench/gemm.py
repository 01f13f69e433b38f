"""``python -m cupyfuse gemm-bench``: our sm90 GEMM engine against cuBLAS.

For each shape (``C = A B^T``, A (M, K), B (N, K), float32 in and out), these variants:

* ``sm90_highest`` -- what precision="highest" runs for that M (gemm.linear_nobias's
  rules): 3xTF32 with big(A)*small(B) in bf16; above ``config.ROUNDED_BIG_MAX_M`` rows the
  fp32 operands themselves are the big halves (read as truncated tf32) and the weight's
  bf16 small half is cached (``_ht``); up to it, round-to-nearest big copies (``_h1rn``).
  Times include splitting A; B's split is a cached derived weight in real use, made
  beforehand. (Variants removed as slower -- all three products in tf32, the weight's
  split or small half made in shared memory, both cross products in bf16, 64 x 256 tiles,
  the 128 x 128 one-pass kernel -- have their numbers in docs/engine.md.)
* ``sm90_high`` -- precision="high": one TF32 pass in the wide-tile kernel on operands
  rounded to nearest tf32 (time includes rounding A, not B); ``_trunc`` on the raw fp32
  bits (truncated by the tensor cores).
* ``sm90_medium`` -- precision="medium": one BF16 pass (time includes converting A).
* cuBLAS float32 (torch.mm, TF32 off), TF32 (TF32 on) and BF16 (bf16 copies, bf16 out).

Reported: median ms (triton.testing.do_bench), TFLOP/s of useful work (2 M N K / time),
GB/s of the minimum traffic (A, B read once, C written once) and the max relative error
against a float64 reference (max |C - ref| / max |ref|) on randn inputs.
"""
from __future__ import annotations

from cupyfuse import config
import json
import sys
import time
from typing import Any

import torch

__all__ = ["run_gemm_bench", "SHAPES"]

SHAPES = [(8192, 8192, 8192), (128, 32768, 32768), (16384, 4096, 4096), (128, 16388, 32768),
          (1024, 512, 8192), (1024, 8192, 8192)]


def _bench(fn: Any) -> float:
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
    except ImportError:  # pragma: no cover - triton ships with CUDA torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            fn()
        times = []
        for _ in range(50):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def run_gemm_bench(shapes: list[tuple[int, int, int]] | None = None,
                   json_path: str | None = None) -> int:
    from cupyfuse.backend import engine, gemm
    from cupyfuse import interop

    if not (torch.cuda.is_available() and interop.cupy_available()):
        print("No GPU found: the GEMM benchmark needs one.")
        return 1
    shapes = shapes or SHAPES
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    hopper = torch.cuda.get_device_capability(dev) == (9, 0)
    print(f"cupyfuse gemm-bench  {time.strftime('%Y-%m-%dT%H:%M:%S%z')}  device: {name}")
    if not hopper:
        print("not a compute capability 9.0 device: the sm90 engine does not run here")
    rows: list[dict[str, Any]] = []
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    call = interop.Call.begin("gemm-bench", torch.zeros(1, 1, device=dev), {}, x_shape_msg="")
    try:
        with call:
            for i, (M, N, K) in enumerate(shapes):
                print(f"[{i + 1}/{len(shapes)}] {M}x{N}x{K}", file=sys.stderr, flush=True)
                g = torch.Generator(device=dev).manual_seed(M + N + K)
                a = torch.randn(M, K, device=dev, generator=g)
                b = torch.randn(N, K, device=dev, generator=g)
                out = torch.empty(M, N, device=dev)
                ref = a.double() @ b.double().T
                refmax = ref.abs().max().item()

                def err(o: torch.Tensor) -> float:
                    return ((o.double() - ref).abs().max().item()) / refmax

                flop = 2.0 * M * N * K
                nbytes = 4.0 * (M * K + N * K + M * N)
                row: dict[str, Any] = {"M": M, "N": N, "K": K}
                torch.backends.cuda.matmul.allow_tf32 = False
                variants = [("cublas_fp32", lambda: torch.mm(a, b.T, out=out))]
                if hopper and engine.supported(a, b):
                    hb, _, hsh, _ = engine.split_hybrid(b, small=False, small_h=True, half=False)
                    hmaps1 = engine.hybrid_b_maps(hb, hsh)

                    wsht = engine.split_hybrid(b, small=False, small_h=True, half=False,
                                               trunc=True)[2]
                    tmaps = engine.hybrid_b_maps(b, wsht)

                    def highest_ht() -> None:   # the weight's small half cached
                        _, as_, _, ah = engine.split_hybrid(a, small=True, small_h=False, half=True,
                                                            trunc=True)
                        engine.gemm_hybrid(a, as_, ah, b, wsht, out, b_maps=tmaps)

                    def highest_h1() -> None:
                        ab, as_, _, ah = engine.split_hybrid(a, small=True, small_h=False, half=True)
                        engine.gemm_hybrid(ab, as_, ah, hb, hsh, out, b_maps=hmaps1)

                    br = engine.split_hybrid(b, small=False, small_h=False, half=False)[0]
                    brmap = engine.wide_b_map(br)

                    def high() -> None:
                        ar = engine.split_hybrid(a, small=False, small_h=False, half=False)[0]
                        engine.gemm_wide(ar, br, out, b_map=brmap)

                    bh = engine.to_bf16(b)
                    bmap = engine.wide_b_map(bh)

                    def medium() -> None:
                        engine.gemm_wide(engine.to_bf16(a), bh, out, b_map=bmap)

                    # what precision="highest" runs for this M (gemm.linear_nobias's rules)
                    highest = highest_h1 if M <= config.ROUNDED_BIG_MAX_M else highest_ht
                    variants += [("sm90_highest", highest),
                                 ("sm90_highest_ht", highest_ht),
                                 ("sm90_highest_h1rn", highest_h1),
                                 ("sm90_high", high),
                                 ("sm90_high_trunc", lambda: engine.gemm_wide(a, b, out)),
                                 ("sm90_medium", medium)]
                for vname, fn in variants:
                    fn()
                    torch.cuda.synchronize()
                    e = err(out)
                    t = _bench(fn)
                    row[vname] = {"ms": t, "tflops": flop / t / 1e9, "gbps": nbytes / t / 1e6,
                                  "max_rel_err": e}
                torch.backends.cuda.matmul.allow_tf32 = True
                fn = lambda: torch.mm(a, b.T, out=out)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                e = err(out)
                t = _bench(fn)
                row["cublas_tf32"] = {"ms": t, "tflops": flop / t / 1e9, "gbps": nbytes / t / 1e6,
                                      "max_rel_err": e}
                torch.backends.cuda.matmul.allow_tf32 = False
                a16, b16 = a.bfloat16(), b.bfloat16()
                o16 = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                fn = lambda: torch.mm(a16, b16.T, out=o16)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                e = err(o16.float())
                t = _bench(fn)
                row["cublas_bf16"] = {"ms": t, "tflops": flop / t / 1e9, "gbps": nbytes / t / 1e6,
                                      "max_rel_err": e}
                del a16, b16, o16
                rows.append(row)
                del a, b, out, ref
                torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    cols = ["sm90_highest", "sm90_highest_ht", "sm90_highest_h1rn", "cublas_fp32", "sm90_high",
            "sm90_high_trunc", "cublas_tf32", "sm90_medium", "cublas_bf16"]
    print("\nms / TFLOP/s / max rel err vs float64 (randn inputs)")
    print(f"{'variant':>20s}  " + "  ".join(f"{r['M']}x{r['N']}x{r['K']}".rjust(28) for r in rows))
    for c in cols:
        cells = []
        for r in rows:
            v = r.get(c)
            cells.append(f"{v['ms']:7.3f} {v['tflops']:6.1f} {v['max_rel_err']:8.1e}".rjust(28)
                         if v else "-".rjust(28))
        print(f"{c:>20s}  " + "  ".join(cells))
    for r in rows:
        hi, tf = r.get("sm90_high"), r.get("cublas_tf32")
        if hi and tf:
            print(f"{r['M']}x{r['N']}x{r['K']}: sm90_high at {tf['ms'] / hi['ms']:.0%} of cuBLAS "
                  "TF32's speed")
    print(f"engine: {gemm.engine_info(dev)['gemm_engine']}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": name, "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    return 0
