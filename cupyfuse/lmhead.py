"""A Linear head and its cross entropy: ``F.cross_entropy(F.linear(x, weight, bias), target)``
with the logits stored at most once, and in the weight gradient's memory.

The logits are computed transposed, ``Lt = weight @ x.T`` (classes x tokens), in chunks of
classes. After each chunk's GEMM a kernel (``kernels_cu/lm_head.cu``) takes every token's
running logsumexp partials over the chunk's classes (max and sum of exponentials, in split
order), the target's logit and the class-weighted sum of logits (label smoothing), and
folds them into a per-token running state: a fixed order, so the loss is the same bits run
to run. Without gradients the chunk is a scratch buffer of ``FORWARD_CHUNKS x CHUNK_BYTES``
at most: the (tokens, V) logits are never stored.

With gradients the logits are kept in the operands' dtype (as eager torch keeps them), and
where tokens <= hidden they live inside the buffer that becomes the weight's gradient:
backward turns them into ``dLoss/dLogits`` in place (the softmax minus the target's
one-hot, class weights and smoothing included, times the incoming gradient), takes
``dx = dLt.T @ weight`` in one GEMM, then writes ``dW`` chunk by chunk into the part of the
buffer whose logits are consumed (the logits start one chunk in, so a chunk's gradient
never overwrites logits still to be read). Peak memory is then the weight gradient, one
chunk and dx; more tokens than hidden keep the logits and dW apart.

GEMMs are torch's (cuBLAS; float32 follows ``torch.backends.cuda.matmul.allow_tf32``),
so the path runs on any CUDA device; on the CPU the kernels' arithmetic runs as torch ops
(the same chunks, partials and folds).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

#: a chunk of logits (classes x tokens) is at most this many bytes: dW is written in such
#: chunks (the kept logits start one chunk in); the forward's GEMMs take FORWARD_CHUNKS
#: of them at a time (fewer, larger GEMMs; without gradients its scratch holds that many)
CHUNK_BYTES = 32 << 20
FORWARD_CHUNKS = 4
_LN2 = math.log(2.0)
_KIND = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_REDUCTIONS = ("mean", "sum", "none")
#: the kernels of kernels_cu/lm_head.cu by (dtype, tokens per thread)
_LSE = {("f32", 1): "lse_partial_f32", ("bf16", 1): "lse_partial_bf16",
        ("bf16", 2): "lse_partial_bf16x2", ("f16", 1): "lse_partial_f16",
        ("f16", 2): "lse_partial_f16x2"}
_GRAD = {("f32", 1): "ce_grad_f32", ("bf16", 1): "ce_grad_bf16", ("bf16", 2): "ce_grad_bf16x2",
         ("f16", 1): "ce_grad_f16", ("f16", 2): "ce_grad_f16x2"}


@torch.compiler.disable   # (a graph break under torch.compile: its kernels are CuPy launches)
def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100,
                         label_smoothing: float = 0.0, class_weight: torch.Tensor | None = None,
                         reduction: str = "mean", z_loss: float = 0.0,
                         chunk_rows: int | None = None, process_group: Any = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(x, weight, bias), target, weight=class_weight,
    ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)``
    without storing the logits (no gradient) or storing them once, in the weight
    gradient's memory (module docstring).

    x: (..., hidden) float32, bfloat16 or float16; weight: (vocab, hidden) and bias:
    (vocab,) in x's dtype; target: x.shape[:-1] integer class indices. The loss has x's
    dtype (as torch gives it); inside, logsumexp and the loss are float32. A target
    outside [0, vocab) that is not ``ignore_index`` gives a NaN loss for its token (torch
    raises a device-side assert). Differentiable in x, weight and bias (once: the saved
    logits become the gradient). Under ``torch.autocast`` float32 operands are cast to
    its dtype (as ``F.linear`` is) and the loss comes back float32 (as autocast gives
    ``F.cross_entropy``'s).

    ``z_loss``: adds ``z_loss * logsumexp(logits)**2`` per (not ignored) token, reduced with
    the cross entropy (PaLM's auxiliary loss; its gradient rides on the softmax term).

    ``chunk_rows``: classes per chunk of dW (default :func:`chunk_rows_for`: 32 MiB of
    logits; the forward's GEMMs take ``FORWARD_CHUNKS`` chunks at a time).

    ``process_group``: the vocabulary sharded over a torch.distributed group (tensor
    parallelism by output features): ``weight`` and ``bias`` are this rank's rows, the
    ranks' shards in rank order making the whole vocabulary (sizes may differ);
    ``class_weight`` and ``target`` are the whole vocabulary's. Each rank runs its shard;
    the per-token partials (max, sum of exponentials, target logit, weighted sum) are
    gathered and folded in rank order, so every rank gets the same loss, the same bits
    run to run; backward gives each rank its shard's dW and db and the whole dx (summed
    over the group in float32).
    """
    dev = getattr(x, "device", None)
    amp = (isinstance(x, torch.Tensor) and torch.is_autocast_enabled(dev.type)
           and x.dtype == torch.float32)
    if amp:   # as F.linear under autocast: the GEMM in autocast's dtype, the loss in float32
        half = torch.get_autocast_dtype(dev.type)
        x = x.to(half)
        weight = weight.to(half) if isinstance(weight, torch.Tensor) else weight
        bias = bias.to(half) if isinstance(bias, torch.Tensor) else bias
    _check(x, weight, target, bias, class_weight, reduction, label_smoothing, process_group)
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = target.reshape(-1).to(torch.int64).contiguous()
    cw = None if class_weight is None else class_weight.to(torch.float32).contiguous()
    if not (isinstance(z_loss, (int, float)) and z_loss >= 0.0 and math.isfinite(z_loss)):
        raise ValueError(f"linear_cross_entropy: z_loss must be a finite number >= 0, got {z_loss!r}")
    opts = (int(ignore_index), float(label_smoothing), reduction, chunk_rows, process_group,
            torch.float32 if amp else x.dtype, float(z_loss))
    with torch.autocast(x.device.type, enabled=False):
        loss = _LinearCrossEntropy.apply(x2, weight.contiguous(), bias, y, cw, opts)
    return loss.view(target.shape) if reduction == "none" else loss


class LinearCrossEntropyLoss(nn.Module):
    """:func:`linear_cross_entropy` as a loss module: ``loss(x, weight, target, bias=None)``
    (the head's weight passed in, as ``nn.Linear.weight`` holds it)."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0,
                 reduction: str = "mean", weight: torch.Tensor | None = None,
                 z_loss: float = 0.0) -> None:
        super().__init__()
        self.ignore_index, self.label_smoothing, self.reduction = ignore_index, label_smoothing, reduction
        self.z_loss = z_loss
        self.register_buffer("weight", weight)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear_cross_entropy(x, weight, target, bias, ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                                    class_weight=self.weight, reduction=self.reduction)


def _check(x: Any, weight: Any, target: Any, bias: Any, cw: Any, reduction: str,
           smoothing: float, group: Any = None) -> None:
    where = "linear_cross_entropy"
    for name, t in (("x", x), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch tensor, got {type(t).__name__}")
    if x.dtype not in _KIND:
        raise TypeError(f"{where}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if weight.dim() != 2 or x.dim() < 1 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{where}: weight must be (vocab, hidden) with hidden = x.shape[-1] "
                         f"= {x.shape[-1] if x.dim() else '?'}, got {tuple(weight.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"{where}: weight and bias must have x's dtype {x.dtype} (got "
                        f"{weight.dtype}{'' if bias is None else ', ' + str(bias.dtype)}): "
                        "cast them, or run under torch.autocast with F.linear")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{where}: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"{where}: target must hold integer class indices, got {target.dtype} "
                        "(for class probabilities use F.cross_entropy on fused logits)")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{where}: target must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, "
                         f"got {tuple(target.shape)}")
    if cw is not None and (not isinstance(cw, torch.Tensor) or cw.dim() != 1 or
                           (group is None and tuple(cw.shape) != (weight.shape[0],))):
        raise ValueError(f"{where}: class_weight must be a ({weight.shape[0]},) tensor"
                         + (" (the whole vocabulary's)" if group is not None else ""))
    devs = {t.device for t in (x, weight, target, bias, cw) if isinstance(t, torch.Tensor)}
    if len(devs) > 1:
        raise ValueError(f"{where}: every tensor must be on one device, got {sorted(map(str, devs))}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{where}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"{where}: label_smoothing must be in [0, 1], got {smoothing}")


def chunk_rows_for(T: int, H: int, esize: int, V: int) -> int:
    """Classes per chunk: a chunk of logits (and of the weight gradient) within
    ``CHUNK_BYTES``, a multiple of 8."""
    rows = CHUNK_BYTES // (max(T, H, 1) * esize)
    return int(max(8, min(V, rows // 8 * 8 or 8)))


def layout(T: int, H: int, V: int, vc: int, grad_w: bool) -> tuple[str, int, int]:
    """(kind, size, logits offset) of the saved buffer, in elements. ``shared``: the
    logits at offset S inside a buffer whose first V*H elements become dW; chunk c's
    gradient (written once chunk c is consumed) ends at (c+1)*vc*H, at or before where
    chunk c's logits start (S + c*vc*T) -- for every c when S = vc*H + (C-1)*vc*(H-T)."""
    if not grad_w or T > H:
        return "apart", V * T, 0
    nc = -(-V // vc)
    S = vc * H + (nc - 1) * vc * (H - T)
    return "shared", max(S + V * T, V * H), S


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x2: torch.Tensor, weight: torch.Tensor, bias: Any, y: torch.Tensor,
                cw: Any, opts: tuple) -> torch.Tensor:
        ignore, ls, reduction, vc, group, out_dtype, zl = opts
        T, H = x2.shape
        V = Vl = weight.shape[0]
        y_loc, cw_loc = y, cw
        if group is not None:   # this rank's classes: [start, start + Vl) of V
            start, V = _shard_of(Vl, group, x2.device)
            y_loc = y - start
            if cw is not None:
                if cw.shape[0] != V:
                    raise ValueError(f"linear_cross_entropy: class_weight must be the whole "
                                     f"vocabulary's ({V},), got {tuple(cw.shape)}")
                cw_loc = cw[start:start + Vl]
        need = ctx.needs_input_grad
        saving = bool(need[0] or need[1] or (bias is not None and need[2]))
        vc = vc or chunk_rows_for(T, H, x2.element_size(), Vl)
        run = _Kernels(x2.device, x2.dtype, T)
        b32 = None if bias is None else bias.to(torch.float32).contiguous()
        if saving:
            kind, size, off = layout(T, H, Vl, vc, bool(need[1]))
            buf = torch.empty(size, dtype=x2.dtype, device=x2.device)
            Lt = buf[off:off + Vl * T].view(Vl, T)
        else:
            kind, buf, Lt = None, None, None
            scratch = torch.empty(min(FORWARD_CHUNKS * vc, Vl) * T, dtype=x2.dtype,
                                  device=x2.device)
        state = run.state()
        want_sz = ls > 0.0
        # the forward in chunks of FORWARD_CHUNKS x vc classes (kept or scratch; vc rules
        # only dW's writes)
        step = FORWARD_CHUNKS * vc
        for c, v0 in enumerate(range(0, Vl, step)):
            rows = min(step, Vl - v0)
            Lc = Lt[v0:v0 + rows] if saving else scratch[:rows * T].view(rows, T)
            torch.mm(weight[v0:v0 + rows], x2.t(), out=Lc)
            run.lse_partial(Lc, v0, b32, cw_loc, y_loc, want_sz, state, first=(c == 0))
        if group is not None:
            state = _fold_ranks(state, group)
        m2, s, zy, sz = state
        lse = (m2 + torch.log2(s)) * _LN2
        valid = y != ignore
        bad = valid & ((y < 0) | (y >= V))
        wy = (cw[y.clamp(0, V - 1)] if cw is not None else torch.ones_like(lse)) * valid
        wsum = float(V) if cw is None else cw.sum()
        loss_t = wy * (lse - zy)
        if ls > 0.0:
            loss_t = (1.0 - ls) * loss_t + (ls / V) * torch.where(valid, wsum * lse - sz, 0.0)
        if zl > 0.0:
            loss_t = loss_t + zl * lse * lse
        loss_t = torch.where(bad, float("nan"), torch.where(valid, loss_t, 0.0))
        denom = wy.sum()
        if reduction == "mean":
            loss = loss_t.sum() / denom
        elif reduction == "sum":
            loss = loss_t.sum()
        else:
            loss = loss_t
        if saving:
            ctx.buf, ctx.Lt, ctx.kind, ctx.vc = buf, Lt, kind, vc
            ctx.save_for_backward(x2, weight, bias, y_loc, cw_loc, lse, wy, valid, bad, denom)
            ctx.opts, ctx.wsum, ctx.V = opts, wsum, V
        return loss.to(out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        if getattr(ctx, "buf", None) is None:
            raise RuntimeError("linear_cross_entropy: backward ran through this loss already "
                               "(its saved logits became the gradients); compute the loss "
                               "again for another backward (retain_graph cannot keep them)")
        x2, weight, bias, y, cw, lse, wy, valid, bad, denom = ctx.saved_tensors
        buf, Lt, kind, vc = ctx.buf, ctx.Lt, ctx.kind, ctx.vc
        ctx.buf = ctx.Lt = None
        ignore, ls, reduction, _, group, _, zl = ctx.opts
        T, H = x2.shape
        V, Vl = ctx.V, weight.shape[0]
        coef = g.to(torch.float32)
        if reduction == "mean":
            coef = coef / denom
        vf = valid.to(torch.float32)
        A = coef * ((1.0 - ls) * wy + (ls * ctx.wsum / V) * vf + (2.0 * zl) * lse)
        B = coef * ((1.0 - ls) * wy)
        C = coef * (ls / V) * vf
        # ignored tokens get exactly 0 (torch's masking, also when every token is ignored
        # and the mean's 0/0 is NaN); a target outside the classes gets NaN
        A, B, C = (torch.where(valid, t, 0.0) for t in (A, B, C))
        A = torch.where(bad, float("nan"), A)
        A, B, C = (t.expand(T).contiguous() for t in (A, B, C))
        run = _Kernels(x2.device, x2.dtype, T)
        b32 = None if bias is None else bias.to(torch.float32).contiguous()
        run.ce_grad(Lt, b32, cw, y, lse * (1.0 / _LN2), A, B, C)
        need = ctx.needs_input_grad
        dx = torch.mm(Lt.t(), weight) if need[0] else None
        if dx is not None and group is not None:
            import torch.distributed as dist

            d32 = dx.to(torch.float32)
            dist.all_reduce(d32, group=group)
            dx = d32.to(dx.dtype)
        db = Lt.sum(1, dtype=torch.float32).to(bias.dtype) if bias is not None and need[2] else None
        dw = None
        if need[1]:
            if kind == "shared":
                for v0 in range(0, Vl, vc):
                    rows = min(vc, Vl - v0)
                    torch.mm(Lt[v0:v0 + rows], x2, out=buf[v0 * H:(v0 + rows) * H].view(rows, H))
                dw = buf[:Vl * H].view(Vl, H)
            else:
                dw = torch.mm(Lt, x2)
        del buf, Lt
        return dx, dw, db, None, None, None


def _shard_of(rows: int, group: Any, device: torch.device) -> tuple[int, int]:
    """(first class of this rank's shard, whole vocabulary) from every rank's shard size."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    mine = torch.tensor([rows], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(sizes, mine, group=group)
    sizes = [int(t.item()) for t in sizes]
    r = dist.get_rank(group)
    return sum(sizes[:r]), sum(sizes)


def _fold_ranks(state: list, group: Any) -> list:
    """Every rank's per-token state (max m2, sum s, target logit, weighted sum), gathered
    and folded in rank order: the same result, bit for bit, on every rank."""
    import torch.distributed as dist

    mine = torch.stack(state)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    m, s, zy, sz = (t.clone() for t in parts[0])
    for p in parts[1:]:
        mn = torch.maximum(m, p[0])
        s = s * _Kernels._exp2_diff(m, mn) + p[1] * _Kernels._exp2_diff(p[0], mn)
        m = mn
        zy = zy + p[2]
        sz = sz + p[3]
    return [m, s, zy, sz]


class _Kernels:
    """The three kernels of ``kernels_cu/lm_head.cu`` on a CUDA device, their arithmetic as
    torch ops on the CPU (the same partials, folds and formulas)."""

    BLOCK = 256

    def __init__(self, device: torch.device, dtype: torch.dtype, T: int) -> None:
        self.device, self.dtype, self.T = device, dtype, T
        self.cuda = device.type == "cuda"
        if self.cuda:
            from cupyfuse.interop import cupy_available

            if not cupy_available():
                raise RuntimeError("linear_cross_entropy on CUDA needs CuPy (pip install "
                                   "cupyfuse[cuda12] or [cuda13])")
            self.dev = device.index if device.index is not None else torch.cuda.current_device()
            self.stream = torch.cuda.current_stream(self.dev).cuda_stream

    def state(self) -> list[torch.Tensor]:
        return [torch.empty(self.T, dtype=torch.float32, device=self.device) for _ in range(4)]

    # -- the GPU kernels -------------------------------------------------------------
    def _vec(self, L: torch.Tensor) -> int:
        return 2 if (L.element_size() == 2 and self.T % 2 == 0 and L.stride(0) % 2 == 0
                     and L.data_ptr() % 4 == 0) else 1

    def _splits(self, rows: int, vec: int) -> tuple[int, int, int]:
        gx = -(-self.T // (self.BLOCK * vec))
        sms = _sm_count(self.dev)
        want = max(1, -(-4 * sms // gx))
        rps = max(8, -(-rows // want))
        rps = -(-rps // 8) * 8
        return gx, -(-rows // rps), rps

    def lse_partial(self, L: torch.Tensor, v0: int, bias: Any, cw: Any, y: torch.Tensor,
                    want_sz: bool, state: list, first: bool) -> None:
        if not self.cuda:
            return self._lse_partial_cpu(L, v0, bias, cw, y, want_sz, state, first)
        import cupy

        from cupyfuse.backend.runtime import get_function, launch

        rows = L.shape[0]
        vec = self._vec(L)
        gx, ns, rps = self._splits(rows, vec)
        part = torch.empty(4, ns, self.T, dtype=torch.float32, device=self.device)
        rm, rs, rzy, rsz = state
        ptr = _ptr
        with cupy.cuda.Device(self.dev):
            launch(get_function("lm_head.cu", _LSE[_KIND[self.dtype], vec], self.dev), (gx, ns), self.BLOCK,
                   (L.data_ptr(), L.stride(0), rows, self.T, v0, ptr(bias), ptr(cw),
                    y.data_ptr(), rps, int(want_sz), part[0].data_ptr(), part[1].data_ptr(),
                    part[2].data_ptr(), part[3].data_ptr(), 0), stream=self.stream)
            launch(get_function("lm_head.cu", "lse_fold", self.dev), -(-self.T // self.BLOCK),
                   self.BLOCK, (part[0].data_ptr(), part[1].data_ptr(), part[2].data_ptr(),
                                part[3].data_ptr(), ns, self.T, rm.data_ptr(), rs.data_ptr(),
                                rzy.data_ptr(), rsz.data_ptr(), int(first)), stream=self.stream)

    def ce_grad(self, Lt: torch.Tensor, bias: Any, cw: Any, y: torch.Tensor, lse2: torch.Tensor,
                A: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> None:
        if not self.cuda:
            return self._ce_grad_cpu(Lt, bias, cw, y, lse2, A, B, C)
        import cupy

        from cupyfuse.backend.runtime import get_function, launch

        rows = Lt.shape[0]
        vec = self._vec(Lt)
        gx, ns, rps = self._splits(rows, vec)
        lse2 = lse2.contiguous()
        with cupy.cuda.Device(self.dev):
            launch(get_function("lm_head.cu", _GRAD[_KIND[self.dtype], vec], self.dev), (gx, ns), self.BLOCK,
                   (Lt.data_ptr(), Lt.stride(0), rows, self.T, 0, _ptr(bias), _ptr(cw),
                    y.data_ptr(), lse2.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(),
                    rps), stream=self.stream)

    # -- the same arithmetic on the CPU ----------------------------------------------
    @staticmethod
    def _exp2_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(a == b, 1.0, torch.exp2(a - b))

    def _lse_partial_cpu(self, L: torch.Tensor, v0: int, bias: Any, cw: Any, y: torch.Tensor,
                         want_sz: bool, state: list, first: bool) -> None:
        rows = L.shape[0]
        z = L.to(torch.float32)
        if bias is not None:
            z = z + bias[v0:v0 + rows].to(torch.float32)[:, None]
        sz = ((cw[v0:v0 + rows, None] if cw is not None else 1.0) * z).sum(0) if want_sz \
            else torch.zeros(self.T)
        inr = (y >= v0) & (y < v0 + rows)
        zy = torch.where(inr, z.gather(0, (y - v0).clamp(0, rows - 1)[None])[0], 0.0)
        z2 = z * (1.0 / _LN2)
        m = torch.where(torch.isnan(z2), -math.inf, z2).amax(0)   # (fmaxf drops NaN)
        s = self._exp2_diff(z2, m[None]).sum(0)
        rm, rs, rzy, rsz = state
        if first:
            rm.fill_(-math.inf), rs.zero_(), rzy.zero_(), rsz.zero_()
        mn = torch.maximum(rm, m)
        rs.copy_(rs * self._exp2_diff(rm, mn) + s * self._exp2_diff(m, mn))
        rm.copy_(mn)
        rzy.add_(zy)
        rsz.add_(sz)

    def _ce_grad_cpu(self, Lt: torch.Tensor, bias: Any, cw: Any, y: torch.Tensor,
                     lse2: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> None:
        V = Lt.shape[0]
        z = Lt.to(torch.float32)
        if bias is not None:
            z = z + bias.to(torch.float32)[:, None]
        p = torch.exp2(z * (1.0 / _LN2) - lse2[None])
        d = A[None] * p - C[None] * (cw[:, None] if cw is not None else 1.0)
        hit = (torch.arange(V)[:, None] == y[None])
        d = d - torch.where(hit, B[None], 0.0)
        Lt.copy_(d)


_sms: dict[int, int] = {}


def _sm_count(dev: int) -> int:
    n = _sms.get(dev)
    if n is None:
        n = _sms[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return n


def _ptr(t: Any) -> int:
    return 0 if t is None else t.data_ptr()


# -- a fused module whose whole forward is a Linear head and its cross entropy ----------
class _Head:
    """``F.cross_entropy(linear(x)[.view(-1, V)], target[.view(-1)], ...)`` read off a
    module's fx graph: where its inputs and options are."""

    __slots__ = ("linear", "ix", "it", "viewed", "weight_attr", "opts")

    def __init__(self, linear: str, ix: int, it: int, viewed: bool, weight_attr: Any,
                 opts: dict) -> None:
        self.linear, self.ix, self.it, self.viewed = linear, ix, it, viewed
        self.weight_attr, self.opts = weight_attr, opts

    def __call__(self, module: nn.Module, args: tuple) -> Any:
        """The loss, or None where the call's shapes are not the head's."""
        if max(self.ix, self.it) >= len(args):
            return None
        x, t = args[self.ix], args[self.it]
        lin = module.get_submodule(self.linear)
        if not (isinstance(x, torch.Tensor) and isinstance(t, torch.Tensor)) or x.dim() < 1:
            return None
        if not self.viewed and (x.dim() != 2 or t.dim() != 1):
            return None   # (without the view, torch reads dim 1 as the classes)
        if t.numel() * x.shape[-1] != x.numel() or t.is_floating_point() or \
                x.dtype != lin.weight.dtype:
            return None   # (mixed dtypes: torch's own error, from the original forward)
        cw = self.weight_attr(module) if self.weight_attr is not None else None
        return linear_cross_entropy(x.reshape(-1, x.shape[-1]), lin.weight, t.reshape(-1),
                                    lin.bias, class_weight=cw, **self.opts)


def head_of(graph: torch.fx.Graph, module: nn.Module) -> _Head | None:
    """The :class:`_Head` of a traced forward that is exactly a Linear submodule, an
    optional ``view``/``reshape`` to (-1, out_features) and ``F.cross_entropy`` /
    ``nn.CrossEntropyLoss`` of integer targets (optionally flattened), returned as is;
    None for anything else."""
    import torch.nn.functional as F

    nodes = list(graph.nodes)
    ph = [n for n in nodes if n.op == "placeholder"]
    out = [n for n in nodes if n.op == "output"]
    if len(out) != 1 or not isinstance(out[0].args[0], torch.fx.Node):
        return None
    ce = out[0].args[0]
    opts: dict = {}
    weight_attr = None
    if ce.op == "call_function" and ce.target is F.cross_entropy:
        kw = dict(zip(("input", "target", "weight", "size_average", "ignore_index", "reduce",
                       "reduction", "label_smoothing"), ce.args))
        kw.update(ce.kwargs)
        if kw.get("size_average") is not None or kw.get("reduce") is not None:
            return None
        w = kw.get("weight")
        if isinstance(w, torch.fx.Node):
            if w.op != "get_attr":
                return None
            name = w.target
            weight_attr = lambda m, name=name: _attr_path(m, name)
        elif w is not None:
            return None
        logits, target = kw.get("input"), kw.get("target")
        for k, d in (("ignore_index", -100), ("reduction", "mean"), ("label_smoothing", 0.0)):
            opts[k] = kw.get(k, d)
    elif ce.op == "call_module" and type(module.get_submodule(ce.target)) is nn.CrossEntropyLoss:
        crit = module.get_submodule(ce.target)
        if len(ce.args) != 2 or ce.kwargs:
            return None
        logits, target = ce.args
        opts = {"ignore_index": crit.ignore_index, "reduction": crit.reduction,
                "label_smoothing": crit.label_smoothing}
        if crit.weight is not None:
            path = ce.target
            weight_attr = lambda m, path=path: m.get_submodule(path).weight
    else:
        return None
    if not (isinstance(opts["ignore_index"], int) and isinstance(opts["reduction"], str)
            and isinstance(opts["label_smoothing"], (int, float))):
        return None
    viewed = False
    lin_node = logits
    if isinstance(lin_node, torch.fx.Node) and lin_node.op == "call_method" and \
            lin_node.target in ("view", "reshape"):
        shape = lin_node.args[1:]
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        lin_node = lin_node.args[0]
        if not (isinstance(lin_node, torch.fx.Node) and lin_node.op == "call_module"):
            return None
        lin = module.get_submodule(lin_node.target)
        if not (isinstance(lin, nn.Linear) and tuple(shape) == (-1, lin.out_features)):
            return None
        viewed = True
    if not (isinstance(lin_node, torch.fx.Node) and lin_node.op == "call_module"
            and type(module.get_submodule(lin_node.target)) is nn.Linear
            and len(lin_node.args) == 1 and lin_node.args[0] in ph):
        return None
    tnode = target
    if isinstance(tnode, torch.fx.Node) and tnode.op == "call_method" and \
            tnode.target in ("view", "reshape", "flatten"):
        if tnode.target != "flatten" and tuple(tnode.args[1:]) not in ((-1,), ((-1,),)):
            return None
        if tnode.target == "flatten" and (tnode.args[1:] or tnode.kwargs):
            return None
        tnode = tnode.args[0]
    if tnode not in ph:
        return None
    used = {ce, lin_node, logits, target, tnode, out[0], *ph}
    if any(n not in used and n.op != "get_attr" for n in nodes):
        return None
    return _Head(lin_node.target, ph.index(lin_node.args[0]), ph.index(tnode), viewed,
                 weight_attr, opts)


def _attr_path(m: nn.Module, name: str) -> Any:
    for part in name.split("."):
        m = getattr(m, part)
    return m
