"""Norms in a traced forward (:mod:`cupyfuse.frontend.translate`): LayerNorm over a value's last dims,
GroupNorm and InstanceNorm of (batch, C, *spatial) values (plain and split: statistics
within each row; InstanceNorm's running statistics in eval mode), and BatchNorm1d /
F.batch_norm (batch statistics in training mode, the running buffers updated as torch
does; running statistics in eval mode), with their per-channel weights and biases.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx
import torch.nn as nn

from cupyfuse.ir import splits
from cupyfuse.frontend.tables import _arg
from cupyfuse.frontend.values import Val, _Weight
from cupyfuse.ir.program import BATCH, LEAD, LEAD_WHY, _fmt_dims
import torch.nn.functional as F
from cupyfuse.frontend import lower as lowering


def layer_norm(ctx, a: Any, shape: tuple, w_src: Any, b_src: Any, eps: float, name: str) -> int:
    v = ctx.val(a, name)
    d = ctx.dims(v)
    tail = d[len(d) - len(shape):]
    if tuple(tail) != tuple(shape):
        raise ctx.refuse(name, f"normalized_shape {shape} does not match the value's last dims")
    ax = ctx.feature_axis(v)
    if ax is None or ax < len(d) - len(shape):
        # over size-1 dims only: each element alone
        z = ctx.b.map("sub", v, v)
        r = ctx.b.map("mul", z, ctx.b.map("rsqrt", ctx.b.map("add", ctx.b.map("square", z),
                                                                    ctx.b.const(eps))))
    else:
        r = ctx.b.normalize_rows(v, ax, eps)
    if w_src is not None:
        r = ctx.b.map("mul", r, ctx.b.param(w_src, shape))
    # torch adds the bias, or 0 without one: a -0.0 (a row of signed zeros) gives +0.0
    return ctx.b.map("add", r, ctx.b.param(b_src, shape) if b_src is not None
                      else ctx.b.const(0.0))


def group_norm(ctx, a: Any, groups: Any, w_src: Any, b_src: Any, eps: float, name: str,
               channels: int | None = None) -> Any:
    """nn.GroupNorm (``channels``: its num_channels) and F.group_norm: a (batch, C,
    *spatial) value, each sample's C channels in ``groups`` groups normalised over
    their channels and spatial positions (biased variance, eps inside the root), then
    the (C,) weight and bias per channel. The features of a group are consecutive in
    the flat row ((C / groups) * prod(spatial) of them, also where the value is split
    into several dims): Builder.group_normalize; a split value's (C,) weight and bias
    are laid out over its spatial positions."""
    sp = ctx._split_of(a)
    v = ctx.val(a, name) if sp is None else sp.v
    d = ctx.dims(v) if sp is None else sp.dims
    groups = ctx._int(groups, "num_groups", name)
    if channels is not None:   # nn.GroupNorm: the flat value's own checks, as before
        ctx._channel_check(d, channels, name)
    # torch's layout: dim 0 the batch, dim 1 the channels (grouped), the rest
    elif len(d) < 2 or d[0] != BATCH or d[1] == BATCH:
        raise ctx.refuse(name, "group_norm of a value whose dim 0 is not the batch "
                                "(its groups would mix the rows)")
    if len(d) >= 2 and d[1] == LEAD:
        raise ctx.refuse(name, "group_norm's channels (dim 1) are a leading (sequence) "
                                "dim: " + LEAD_WHY)
    if groups < 1 or d[1] % groups:
        raise ctx.refuse(name, f"group_norm: {d[1]} channels (dim 1) do not split "
                                f"into {groups} groups (torch raises)")
    c = d[1]
    for src in (w_src, b_src):
        n = _numel(ctx, src)
        if n is not None and n != c:
            raise ctx.refuse(name, f"group_norm with a weight or bias of {n} elements "
                                    f"for {c} channels (torch raises RuntimeError)")
    r = ctx.b.group_normalize(v, groups, eps)
    if sp is None:
        return ctx.b.affine(r, w_src, b_src, c)
    shape = (c,) + (1,) * (len(d) - 2)
    for src, op in ((w_src, "mul"), (b_src, "add")):
        if src is not None:
            r = ctx.b.map(op, r, splits.layout(ctx.b, ctx.b.param(src, (c,)), shape, d))
    return ctx._mk(r, d)


def instance_norm(ctx, a: Any, w_src: Any, b_src: Any, c: Any, eps: float, name: str,
                  no_batch_dim: int | None = None,
                  running: tuple[Any, Any] | None = None) -> Any:
    """torch's instance norm: a (N, C, *spatial) value, each (sample, channel)
    normalised over all its spatial dims. ``no_batch_dim`` (an nn.InstanceNormXd's
    rank of an unbatched input: 2, 3 or 4; None for F.instance_norm, which takes
    batched input only) makes a value of that rank one unbatched (C, *spatial) sample,
    as the module reads it. Fused where the spatial dims hold no row dim (the batch or
    a leading dim): the statistics then run along the features of each row (a
    (batch, C, L) split value: per channel, over groups of L features). ``running``:
    (running_mean, running_var) sources where torch uses them instead (eval mode with
    track_running_stats, F.instance_norm's use_input_stats=False): each channel's
    ``(v - mean) * rsqrt(var + eps)``, nothing updated."""
    sp = ctx._split_of(a)
    v = ctx.val(a, name) if sp is None else sp.v
    d = ctx.dims(v) if sp is None else sp.dims
    if len(d) < 2:
        raise ctx.refuse(name, "InstanceNorm of a value with fewer than 2 dims")
    nd = len(d)
    unbatched = False
    if no_batch_dim is not None:
        if nd not in (no_batch_dim, no_batch_dim + 1):
            # torch's own error (nn.InstanceNormXd._check_input_dim), at every call
            raise ValueError(f"expected {no_batch_dim}D or {no_batch_dim + 1}D input "
                             f"(got {nd}D input)")
        unbatched = nd == no_batch_dim
    ch = 0 if unbatched else 1
    spatial = d[ch + 1:]
    if running is None and any(x in (BATCH, LEAD) for x in spatial):
        raise ctx.refuse(name, f"InstanceNorm of a value of shape {_fmt_dims(d)}: torch "
                          f"normalises each {'channel (dim 0' if unbatched else '(sample, channel) (dims 0, 1'}"
                          f") over {_fmt_dims(spatial)}, across rows; cupyfuse fuses "
                          "a norm over the features of each row")
    if running is None and math.prod(spatial) == 1:
        # torch's own error (instance statistics of one element), at every call
        size = [ctx.shapes[0][0] if x == BATCH else x for x in d]
        if unbatched:   # the module reads it as (1, C, *spatial)
            size = [1] + size
        raise ValueError("Expected more than 1 spatial element when training, got input "
                         f"size {torch.Size(size)}")
    per_channel = running is not None or w_src is not None or b_src is not None
    if per_channel and (unbatched or d[ch] in (BATCH, LEAD)):
        what = "running statistics" if running is not None else "affine"
        raise ctx.refuse(name, f"InstanceNorm with {what} of a value of shape "
                          f"{_fmt_dims(d)}" + (" (torch reads it unbatched: its weight "
                                               "would go with the rows)" if unbatched else
                                               ": its weight would go with the rows"))
    if c is not None and (w_src is not None or b_src is not None) and d[ch] != c:
        # torch's own error (nn.InstanceNormXd.forward), at every call
        raise ValueError(f"expected input's size at dim={ch} to match num_features "
                         f"({c}), but got: {d[ch]}.")
    for src in (w_src, b_src) + (running or ()):
        n = _numel(ctx, src)
        if n is not None and n != d[ch]:
            raise ctx.refuse(name, f"InstanceNorm with a weight, bias or running "
                                    f"statistic of {n} elements for {d[ch]} channels "
                                    "(torch raises RuntimeError)")
    b = ctx.b
    shape = (d[ch],) + (1,) * len(spatial)

    def param(src: Any) -> int:   # a (C,) tensor per channel, laid out over the value
        if sp is None:
            return b.param(src, shape)
        return splits.layout(b, b.param(src, (d[ch],)), shape, d)
    if running is not None:
        r = b.map("mul", b.map("sub", v, param(running[0])),
                  b.map("rsqrt", b.map("add", param(running[1]), b.const(eps))))
    elif sp is not None:
        r = splits.layer_norm(b, v, d, list(range(ch + 1, nd)), eps)
    else:
        r = b.normalize_rows(v, ch + 1 + next(i for i, x in enumerate(spatial) if x > 1),
                             eps)
    if w_src is not None:
        r = b.map("mul", r, param(w_src))
    # torch adds the bias, or 0 without one: -0.0 gives +0.0
    r = b.map("add", r, param(b_src) if b_src is not None else b.const(0.0))
    return r if sp is None else ctx._mk(r, d)


def batch_norm(ctx, a: Any, target: str, mod: nn.BatchNorm1d, name: str,
               rows: bool = False) -> int:
    """nn.BatchNorm1d as torch's _BatchNorm.forward reads it: batch statistics in
    training mode, and in eval mode where *both* running buffers are None (the buffers
    decide, not ``track_running_stats``); running statistics updated in training mode
    where the flag is set and the buffers exist; a weight or bias slot that is None is
    no scale or no shift. ``rows``: statistics over every row of a (batch, seq...,
    C) value, channels its features (a transposed (batch, C, seq) value's BatchNorm,
    :meth:`_perm_batch_norm`)."""
    v = ctx.val(a, name)
    d = ctx.dims(v)
    back = None
    if rows:
        if d[-1] != mod.num_features and not (d[-1] == 1 and mod.num_features == 1):
            raise ctx.refuse(name, f"needs its {mod.num_features} channels in dim 1, "
                                    f"got {max(d[-1], 1)} (torch raises)")
    elif len(d) == 3 and d[0] == BATCH and d[2] == 1:
        # (batch, C, 1): the statistics of (batch, C) (a transpose of a sequence of one)
        back, v = d, ctx.b.view(v, (BATCH, d[1]))
        ctx._channel_check(ctx.dims(v), mod.num_features, name)
    elif len(d) == 3 and d[0] == BATCH and d[1] == 1 and d[2] == LEAD:
        # (batch, 1, seq): one channel over every (batch, seq) row (the transpose of a
        # value of one feature)
        saved = ctx.env[a]
        try:
            ctx.env[a] = Val(ctx.b.view(v, (BATCH, LEAD, 1)))
            r = batch_norm(ctx, a, target, mod, name, rows=True)
        finally:
            ctx.env[a] = saved
        return ctx.b.view(r, d)
    elif len(d) != 2:
        raise ctx.refuse(name, "BatchNorm1d on a value that is not (batch, features)")
    else:
        ctx._channel_check(ctx.dims(v), mod.num_features, name)
    w = f"{target}.weight" if mod.weight is not None else None
    bb = f"{target}.bias" if mod.bias is not None else None
    rm_t, rv_t = mod.running_mean, mod.running_var
    nbt_t = getattr(mod, "num_batches_tracked", None)
    c = mod.num_features
    if (rm_t is None) != (rv_t is None):
        if mod.training and not mod.track_running_stats:
            pass   # torch passes neither buffer then
        elif mod.training:
            raise ctx.refuse(name, "running_mean and running_var must either both be "
                                    "None or neither be None (torch raises)")
        else:
            raise ctx.refuse(name, f"{'running_mean' if rm_t is None else 'running_var'}"
                                    " must be defined in evaluation mode (torch raises)")
    if mod.training:
        running = None
        if mod.track_running_stats and (rm_t is not None or nbt_t is not None):
            if rm_t is None or nbt_t is None:
                raise ctx.refuse(name, "BatchNorm1d in training mode with "
                                  f"{'num_batches_tracked' if rm_t is not None else 'running_mean/running_var'}"
                                  " None and the other buffers set (set both to None, or "
                                  "neither)")
            running = (f"{target}.running_mean", f"{target}.running_var",
                       f"{target}.num_batches_tracked")
        r = ctx.b.batchnorm_train(v, mod.eps, mod.momentum, running, rows=rows)
    elif rm_t is None:   # eval without running buffers: batch statistics, no update
        r = ctx.b.batchnorm_train(v, mod.eps, mod.momentum, None, rows=rows)
    else:   # eval with the buffers, whatever track_running_stats says
        r = ctx.b.batchnorm_eval(v, f"{target}.running_mean", f"{target}.running_var",
                                  mod.eps, rows=rows)
    r = ctx.b.affine(r, w, bb, c, rows=rows)
    # torch adds the bias, or 0 without one: -0.0 gives +0.0
    r = r if bb is not None else ctx.b.map("add", r, ctx.b.const(0.0))
    return r if back is None else ctx.b.view(r, back)


def batch_norm_fn(ctx, args: tuple, kw: dict, name: str, rows: bool = False) -> int:
    """F.batch_norm (``rows``: over every row of a (batch, seq..., C) value, as
    :meth:`batch_norm`)."""
    v = ctx.val(args[0], name)
    rm, rv = _src(ctx, _arg(args, kw, 1, "running_mean")), _src(ctx, _arg(args, kw, 2, "running_var"))
    w, bb = _src(ctx, _arg(args, kw, 3, "weight")), _src(ctx, _arg(args, kw, 4, "bias"))
    training = _arg(args, kw, 5, "training", False)
    momentum = _arg(args, kw, 6, "momentum", 0.1)
    eps = _arg(args, kw, 7, "eps", 1e-5)
    d = ctx.dims(v)
    back = None
    if not rows and len(d) == 3 and d[0] == BATCH and d[2] == 1:   # (batch, C, 1)
        back, v = d, ctx.b.view(v, (BATCH, d[1]))
        d = ctx.dims(v)
    elif not rows and len(d) == 3 and d[0] == BATCH and d[1] == 1 and d[2] == LEAD:
        # (batch, 1, seq): one channel over every (batch, seq) row
        rows, back, v = True, d, ctx.b.view(v, (BATCH, LEAD, 1))
        d = ctx.dims(v)
    if len(d) != 2 and not rows:
        raise ctx.refuse(name, "batch_norm on a value that is not (batch, features)")
    c = max(d[-1], 1)
    for what, src in (("running_mean", rm), ("running_var", rv), ("weight", w),
                      ("bias", bb)):
        k = _numel(ctx, src)
        if k is not None and k != c:
            raise ctx.refuse(name, f"its {what} has {k} elements for {c} channels "
                                    "(torch raises)")
    if not training and (rm is None or rv is None):
        raise ctx.refuse(name, f"{'running_mean' if rm is None else 'running_var'} must "
                                "be defined in evaluation mode (torch raises)")
    if training and (rm is None) != (rv is None):
        raise ctx.refuse(name, "running_mean and running_var must either both be None "
                                "or neither be None (torch raises)")
    if training:
        if rm is not None and momentum is None:
            raise ctx.refuse(name, "F.batch_norm with momentum=None")
        r = ctx.b.batchnorm_train(v, eps, momentum, None, rows=rows)
        if rm is not None:
            raise ctx.refuse(name, "F.batch_norm updating running stats (use nn.BatchNorm1d)")
    else:
        r = ctx.b.batchnorm_eval(v, rm, rv, eps, rows=rows)
    r = ctx.b.affine(r, w, bb, c, rows=rows)
    r = r if bb is not None else ctx.b.map("add", r, ctx.b.const(0.0))
    return r if back is None else ctx.b.view(r, back)

# --- weights, biases and channels of a norm ------------------------------------------
def _src(ctx, a: Any) -> Any:
    if a is None:
        return None
    v = ctx.env.get(a) if isinstance(a, torch.fx.Node) else a
    if isinstance(v, _Weight):
        return v.source
    if isinstance(v, torch.Tensor):
        return v.detach()
    raise ctx.refuse("a norm's weight/bias", "is not a parameter or tensor")


def _numel(ctx, src: Any) -> int | None:
    """The number of elements of a weight or bias source (None: none given)."""
    if src is None:
        return None
    return src.numel() if isinstance(src, torch.Tensor) else ctx._get_attr(src).numel()


# --- spellings ---------------------------------------------------------------------------
@lowering.function(F.layer_norm)
def _layer_norm_fn(ctx, node, args, kw, name):
    return layer_norm(ctx, args[0], ctx.ints(_arg(args, kw, 1, "normalized_shape"), name),
                      _src(ctx, _arg(args, kw, 2, "weight")), _src(ctx, _arg(args, kw, 3, "bias")),
                      _arg(args, kw, 4, "eps", 1e-5), name)


@lowering.function(F.group_norm)
def _group_norm_fn(ctx, node, args, kw, name):
    return group_norm(ctx, args[0], _arg(args, kw, 1, "num_groups"),
                      _src(ctx, _arg(args, kw, 2, "weight")), _src(ctx, _arg(args, kw, 3, "bias")),
                      _arg(args, kw, 4, "eps", 1e-5), name)


@lowering.function(F.instance_norm)
def _instance_norm_fn(ctx, node, args, kw, name):
    rm, rv = _arg(args, kw, 1, "running_mean"), _arg(args, kw, 2, "running_var")
    use = _arg(args, kw, 5, "use_input_stats", True)
    if not isinstance(use, bool):
        raise ctx.refuse(name, f"use_input_stats={use!r} is not a bool")
    if use and (rm is not None or rv is not None):
        raise ctx.refuse(name, "F.instance_norm with running_mean/running_var and "
                               "use_input_stats=True (it updates them from the batch); pass "
                               "use_input_stats=False to normalise with them, or leave them out")
    if not use and (rm is None or rv is None):
        raise ctx.refuse(name, "F.instance_norm with use_input_stats=False and no "
                               "running_mean/running_var (torch raises)")
    return instance_norm(ctx, args[0], _src(ctx, _arg(args, kw, 3, "weight")),
                         _src(ctx, _arg(args, kw, 4, "bias")), None,
                         _arg(args, kw, 7, "eps", 1e-5), name,
                         running=None if use else (_src(ctx, rm), _src(ctx, rv)))


@lowering.function(F.batch_norm)
def _batch_norm_fn(ctx, node, args, kw, name):
    return batch_norm_fn(ctx, args, kw, name)


@lowering.module(nn.LayerNorm)
def _layer_norm_module(ctx, node, mod, a, name):
    return layer_norm(ctx, a, tuple(mod.normalized_shape),
                      f"{node.target}.weight" if mod.weight is not None else None,
                      f"{node.target}.bias" if mod.bias is not None else None, mod.eps, name)


@lowering.module(nn.GroupNorm)
def _group_norm_module(ctx, node, mod, a, name):
    # (a slot set to None after construction: no scale / no shift, as torch)
    return group_norm(ctx, a, mod.num_groups,
                      f"{node.target}.weight" if mod.weight is not None else None,
                      f"{node.target}.bias" if mod.bias is not None else None,
                      mod.eps, name, mod.num_channels)


@lowering.module(nn.BatchNorm1d)
def _batch_norm_module(ctx, node, mod, a, name):
    return batch_norm(ctx, a, node.target, mod, name)


@lowering.module(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
def _instance_norm_module(ctx, node, mod, a, name):
    running = None
    if mod.track_running_stats:
        # torch: instance statistics (and running ones updated) in training mode, the
        # running statistics in eval mode
        if mod.training:
            raise ctx.refuse(name, "InstanceNorm with track_running_stats=True in training "
                                   "mode (it updates its running statistics from the batch); "
                                   "call model.eval(), where it uses them, or set "
                                   "track_running_stats=False")
        if mod.running_mean is None or mod.running_var is None:
            raise ctx.refuse(name, "InstanceNorm with track_running_stats=True and no "
                                   "running_mean/running_var buffers (torch raises)")
        running = (f"{node.target}.running_mean", f"{node.target}.running_var")
    return instance_norm(ctx, a, f"{node.target}.weight"
                         if mod.affine and mod.weight is not None else None,
                         f"{node.target}.bias" if mod.affine and mod.bias is not None else None,
                         mod.num_features, mod.eps, name, no_batch_dim=mod._get_no_batch_dim(),
                         running=running)
