"""Certified row maxima on the GPU: the certification kernel of a chain
(:mod:`cupyfuse.ir.certify` finds the chains; ``kernels_cu/tail_certify.cuh`` holds the
kernel's body and explains the bound), its sizes, the weight's bounds, and its launch.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Sequence

import torch

from cupyfuse import caches
from cupyfuse import config
from cupyfuse.ir.certify import Chain, _leaf
from cupyfuse.ir.program import Program
from cupyfuse.ops.registry import MAPS, cuda_float

__all__ = ["source", "weight_bounds", "gamma", "smem", "weight_data", "run"]


def _operand(prog: Program, leaf: int, params: list[int]) -> str:
    n = prog.nodes[leaf]
    if n.kind == "const":
        return cuda_float(n.attrs[0])
    if n.kind == "iota":
        start, _, step = n.attrs
        return cuda_float(start) if step == 0.0 else f"(float)({start!r} + (double)n * {step!r})"
    if leaf not in params:
        params.append(leaf)
    return f"p{leaf}[(long long)n * p{leaf}_sf]" if n.width > 1 else f"p{leaf}[0]"


def source(prog: Program, chain: Chain) -> tuple[str, str, list[int]]:
    """(kernel name, CUDA source, the param nodes it reads: pointer and feature stride
    each, after the fixed parameters) of the certification kernel of ``chain``."""
    nodes = prog.nodes
    params: list[int] = []
    body = []
    vbody = []   # the chain's ops at a point: the tail's value, for its row reduction
    for u, pos in chain.steps:
        n = nodes[u]
        rule = MAPS[n.op].ranges[pos]
        ops = []
        checks = []
        for j, a in enumerate(n.args):
            if j == pos:
                ops.append("t")
                continue
            o = _operand(prog, _leaf(prog, a), params)
            ops.append(f"o{j}")
            body.append(f"const float o{j}_{u} = {o};")
            vbody.append(body[-1])
            if rule.finite:
                checks.append(f"!isfinite(o{j}_{u})")
            if rule.nonzero:
                checks.append(f"o{j}_{u} == 0.0f")
        ops = [o if o == "t" else f"{o}_{u}" for o in ops]
        kw = {f"a{j}": cuda_float(x) for j, x in enumerate(n.attrs)}
        frag = MAPS[n.op].cuda.format(*ops, **kw)
        vbody.append(f"t = {frag};  // {n.op}")
        if rule.pole:
            checks.append("!(lo > 0.0f || hi < 0.0f)")
        body.append(f"auto g{u} = [&](float t) -> float {{ return {frag}; }};  // {n.op}")
        if checks:
            body.append(f"if ({' || '.join(checks)}) return false;")
        body.append(f"{{ const float a = g{u}(lo), b = g{u}(hi);")
        body.append("  if (a != a || b != b) return false;")
        body.append("  float nlo = fminf(a, b), nhi = fmaxf(a, b);")
        for c in rule.points(n.attrs):
            cl = cuda_float(c)
            body.append(f"  if (lo < {cl} && {cl} < hi) {{ const float m = g{u}({cl}); "
                        "if (m != m) return false; nlo = fminf(nlo, m); nhi = fmaxf(nhi, m); }")
        body.append("  lo = nlo; hi = nhi; mag = fmaxf(mag, fmaxf(fabsf(lo), fabsf(hi))); }")
    if chain.is_min:   # the kernel certifies a maximum: of -f
        body.append("{ const float t = lo; lo = -hi; hi = -t; }")
    body.append("return true;")
    vbody.append("return t;")
    pdecl = "".join(f", const float* __restrict__ p{i}, long long p{i}_sf" for i in params)
    pcap = "\n".join("    " + b for b in body)
    vcap = "\n".join("    " + b for b in vbody)
    digest = hashlib.sha256((pdecl + pcap + vcap + str((THREADS, MIN_BLOCKS, chain.is_min))
                             ).encode()).hexdigest()[:12]
    name = f"cf_cert_{digest}"
    src = f"""#define CF_CERT_THREADS {THREADS}
#define CF_CERT_MIN_BLOCKS {MIN_BLOCKS}
#include "tail_ops.cuh"
#include "tail_certify.cuh"

extern "C" __global__ void __launch_bounds__(CF_CERT_THREADS, CF_CERT_MIN_BLOCKS) {name}(
    const float* __restrict__ x, long long ldx, int K, int vec, const float* __restrict__ w,
    long long ldw, const float* __restrict__ wnorm, const float* __restrict__ wulp, double gamma,
    double wmax, const float* __restrict__ bias, const float* P, int splits, long long sstride,
    long long ldp, float* h, long long ldh, int N, int* __restrict__ counts, int staged,
    const float* __restrict__ fw, long long fldn, long long fldk, const float* __restrict__ fa,
    const float* __restrict__ fc, int fk, int fst, float* __restrict__ red_out{pdecl}) {{
  auto chain = [&](int n, float& lo, float& hi, float& mag) -> bool {{
{pcap}
  }};
  auto value = [&](int n, float t) -> float {{
{vcap}
  }};
  cf_cert_row(x, ldx, K, vec, w, ldw, wnorm, wulp, gamma, wmax, bias, P, splits, sstride, ldp,
              h, ldh, N, counts, staged, fw, fldn, fldk, fa, fc, fk, fst, red_out,
              {int(chain.is_min)}, chain, value);
}}
"""
    return name, src, params


def weight_bounds(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row n of the float32 weight: (||W_n||, ||ulp13(W_n)||) as float32 rounded up,
    computed in float64 (``tail_certify.cuh``'s cf_ulp13 on the host). A float64 norm of K
    terms is within (K + 2) 2^-53 of the exact one, relatively (the squares and their sum
    rounded, then the square root): raised by twice that before the float32 rounding up,
    it bounds the exact norm (a row dominated by one element came out below it)."""
    wd = w.double()
    a = wd.abs()
    _, e = torch.frexp(w)   # |v| = m 2^e, m in [0.5, 1): the tf32 spacing is 2^(e - 11)
    ulp = torch.ldexp(torch.ones_like(wd), (e - 11).to(torch.int32))
    ulp = torch.where(a < 2.0 ** -126, a, ulp)
    lift = 1.0 + (w.shape[1] + 2) * 2.0 ** -52
    return _up(wd.norm(dim=1) * lift), _up(ulp.norm(dim=1) * lift)


def _up(v: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded up (a step up where the cast went below: subnormal
    results too)."""
    f = v.float()
    return torch.where(f.double() < v, torch.nextafter(f, torch.full_like(f, math.inf)),
                       f).contiguous()


def gamma(K: int, splits: int) -> float:
    """The accumulation term of the bound, relative to (X + DX)(Wn + DW): each wgmma k8 step
    adds 8 exact tf32 products and its accumulator with at most 10 float32 units
    (2^-23: truncating alignment) of their magnitudes; a split's chain is its K blocks
    (32 elements: 4 steps); the split-K sum adds ``splits`` float32 roundings."""
    kblocks = -(-K // 32)
    steps = 4 * -(-kblocks // splits)
    return 2.0 ** -23 * (10 * (steps + 2) + 2 * splits)


last_counts: torch.Tensor | None = None


def _kernel(prog: Program, chain: Chain, dev: int) -> tuple[Any, list[int]]:
    from cupyfuse.backend.runtime import generated_kernel

    key = (id(prog), chain, dev)
    hit = _kernels.get(key)
    if hit is not None and hit[0]() is prog:
        return hit[1], hit[2]
    import weakref

    name, src, params = source(prog, chain)
    fn = generated_kernel(name, src, dev)
    _kernels[key] = (weakref.ref(prog), fn, params)
    return fn, params


_kernels: dict = caches.register("certification kernels", {})


#: the certification kernel's threads per block (one block per row) and resident blocks
#: per SM (its launch bounds)
THREADS = 256
MIN_BLOCKS = 4
#: x's row is staged in shared memory for the candidates' dot products up to this many
#: bytes, and the row's TF32 values up to ZS_MAX_BYTES (4 blocks of 256 threads per SM
#: stay resident up to ~56 KB each)
XS_MAX_BYTES = 40 * 1024
ZS_MAX_BYTES = 16 * 1024


def smem(K: int, N: int, red_only: bool = False) -> tuple[int, int]:
    """(dynamic shared memory bytes, staged flags: 1 x's row, 2 the row's TF32 values, 4
    h not written) of the certification kernel; ``red_only``: it writes the row reduction
    (:func:`red_only`), which is then the GEMM value's only use (:func:`find`: the GEMM
    and the chain's values have one user each and are no results), so with the TF32
    values in shared memory the certified rows write nothing to h (two stores of every
    element saved: 0.7 us on 98, docs/engine.md)."""
    xb, zb = 4 * ((K + 3) & ~3), 4 * ((N + 3) & ~3)
    xs, zs = xb <= XS_MAX_BYTES, zb <= ZS_MAX_BYTES
    return (xb if xs else 0) + (zb if zs else 0) + 4 * -(-N // 32), \
        int(xs) | 2 * int(zs) | 4 * int(zs and red_only)


def weight_data(w: torch.Tensor, owner: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, bytes, float]:
    """The weight's (norms, ulp norms, wide-kernel tensor map, max |W|), cached on
    ``owner`` (default the weight itself: a folded weight, a derived copy)."""
    from cupyfuse.backend import engine
    from cupyfuse import caches

    def build() -> tuple:
        wn, wu = weight_bounds(w)
        return wn, wu, engine.wide_b_map(w), float(w.abs().max())

    return caches.cached("certify_bounds", w if owner is None else owner, (w,), (), build)


def _fold_args(fold: tuple | None) -> tuple:
    """The kernel's fw, fldn, fldk, fa, fc, fk, fst for ``fold`` (W, a, c, window, stride);
    zeros for a plain GEMM."""
    if fold is None:
        return (0, 0, 0, 0, 0, 0, 0)
    w, a, c, k, st = fold
    return (w.data_ptr(), w.stride(0), w.stride(1), a.data_ptr(), c.data_ptr(), k, st)


def run(prog: Program, chain: Chain, x: torch.Tensor, w: torch.Tensor, h: torch.Tensor,
        param_values: Callable[[Sequence[int]], list], *, bias: torch.Tensor | None = None,
        wmax: float | None = None, fold: tuple | None = None,
        red_out: torch.Tensor | None = None, owner: torch.Tensor | None = None) -> str:
    """``h = x @ w.T`` by one TF32 pass, certified for ``chain`` (the candidates in fp32).

    A folded GEMM (average pooling, rewrite.py) is finished here as tail_rewrite.cu's
    fold_rows would: it passes its folded ``bias`` (added to every value), the guard's
    ``wmax`` (the original weight's max |W|) and ``fold`` = (original weight W, a, c,
    window, stride) for the direct recomputation of guard rows. Without ``fold`` (a plain
    GEMM) guard rows are recomputed here in full with ``w``. ``red_out`` (float32, one per
    row): the chain's row max/min written too, where it is what the program needs (no
    tail pass: :func:`red_only`). ``param_values(params)``:
    the (pointer, feature stride) launch values of the chain's param nodes; ``owner``
    keys the weight's cached bounds. The engine's label."""
    from cupyfuse.backend import engine
    from cupyfuse.backend.runtime import launch

    M, K = x.shape
    N = w.shape[0]
    dev = x.device.index
    wn, wu, wmap, wabs = weight_data(w, owner)
    fn, params = _kernel(prog, chain, dev)
    P, splits, sstride, ldp = engine.gemm_wide_parts(x, w, h, b_map=wmap)
    assert splits <= config.CERTIFY_MAX_SPLITS, splits
    nbytes, staged = smem(K, N, red_out is not None)
    global last_counts
    counts = torch.empty(M, dtype=torch.int32, device=x.device) if config.CERTIFY_RECORD else None
    vec = int(K % 4 == 0 and x.stride(0) % 4 == 0 and x.data_ptr() % 16 == 0)
    launch(fn, M, THREADS,
           (x.data_ptr(), x.stride(0), K, vec, w.data_ptr(), w.stride(0), wn.data_ptr(),
            wu.data_ptr(), gamma(K, splits), wabs if wmax is None else wmax,
            0 if bias is None else bias.data_ptr(), P.data_ptr(), splits, sstride, ldp,
            h.data_ptr(), h.stride(0), N, 0 if counts is None else counts.data_ptr(), staged,
            *_fold_args(fold), 0 if red_out is None else red_out.data_ptr(),
            *param_values(params)),
           shared_mem=nbytes, dependent=True)   # x's pass overlaps the GEMM's end
    if config.CERTIFY_RECORD:
        last_counts = counts
    return "sm90-tf32-certified"
