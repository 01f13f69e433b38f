"""The torch functions, methods and modules the translator (:mod:`cupyfuse.frontend.translate`)
knows, by family (unary, binary, comparisons, reductions, views, reorders, channel ops,
elementwise ops...), and small helpers that read fx nodes (an argument by position or
name, an op's name in messages, whether a node is a view or an expand). Every
``capture_*`` module reads them; this module imports none of those.
"""
from __future__ import annotations

import ast as _ast
import operator
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse.ops.registry import Op, spellings


#: an augmented assignment's operator -> the function torch.fx records for it on a Proxy
#: (which has no __iadd__: ``g += 1`` is traced as ``g = g + 1``, in place on a tensor)
_AUG_ASSIGN_FUNCS = {_ast.Add: operator.add, _ast.Sub: operator.sub, _ast.Mult: operator.mul,
                     _ast.Div: operator.truediv, _ast.Pow: operator.pow}


# ops whose result shares memory with their first argument (a view of it)
_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "unsqueeze", "squeeze", "flatten",
                 "transpose", "t", "permute", "narrow", "detach", "expand", "expand_as",
                 "contiguous", "unflatten", "movedim", "swapaxes", "chunk", "split", "unbind",
                 "swapdims", "moveaxis"}
_VIEW_FUNCS = {operator.getitem, torch.reshape, torch.unsqueeze, torch.squeeze, torch.flatten,
               torch.transpose, torch.t, torch.permute, torch.narrow, torch.detach,
               torch.chunk, torch.split, torch.unbind, torch.movedim, torch.swapaxes,
               torch.swapdims, torch.moveaxis}


#: ops that reorder a value's dims (Translator._reorder): function -> its method's name
_REORDER_FUNCS: dict[Any, str] = {torch.transpose: "transpose", torch.swapaxes: "swapaxes",
                                  torch.swapdims: "swapdims", torch.permute: "permute",
                                  torch.t: "t", torch.movedim: "movedim",
                                  torch.moveaxis: "moveaxis"}
_REORDER_METHODS = frozenset({"transpose", "swapaxes", "swapdims", "permute", "t", "movedim",
                              "moveaxis"})


#: a (batch, C, L) input flattened before its first Linear (a CNN head)
_FLATTEN_INPUT_WHY = (
    "flattening some of an input's dims into its features: cupyfuse reads an input as "
    "(batch, prod(other dims)) rows where every use of it flattens all its dims after the "
    "batch (`x.view(x.size(0), -1)`, `x.view(-1, 784)`, `x.flatten(1)`) or reads "
    "`x.size(0)`, and otherwise as (batch, seq..., features): rows of its last dim; "
    "flatten it before the call, `model(x.flatten(1))`, and drop the flatten from the "
    "forward (or fuse the part after it)")


def _is_view_node(n: Any) -> bool:
    if not isinstance(n, torch.fx.Node) or not n.args:
        return False
    if n.op == "call_method":
        return n.target in _VIEW_METHODS
    if n.op == "call_function":
        return n.target in _VIEW_FUNCS
    return False


def op_of_function(f: Any) -> Op | None:
    """The op-table record a torch callable spells (``torch.sinh``, ``F.silu``,
    ``operator.add``), or None."""
    try:
        return spellings()["functions"].get(f)
    except TypeError:   # (an unhashable target)
        return None


def op_of_method(m: str) -> Op | None:
    """The op-table record a tensor method spells (``"sinh"``, ``"sinh_"``), or None."""
    return spellings()["methods"].get(m)


def op_of_module(mod: Any) -> Op | None:
    """The op-table record an nn.Module instance spells: its class, or a base class
    registered there whose forward it does not override (``nn.ReLU6`` is a record of its
    own, before its base ``nn.Hardtanh``), or None."""
    mods = spellings()["modules"]
    tp = type(mod)
    for cls in tp.__mro__:
        if cls in mods:
            return mods[cls] if tp.forward is cls.forward else None
    return None


#: shrink activations (thresholds read as numbers, torch's refusals): function -> kind
_SHRINK_FUNCS: dict[Any, str] = {
    F.threshold: "threshold", torch.threshold: "threshold", F.hardshrink: "hardshrink",
    torch.hardshrink: "hardshrink", F.softshrink: "softshrink",
    torch._C._nn.softshrink: "softshrink",
}
#: functions torch raises on for a boolean first operand besides the op table's
#: activations and composites (softmax, norms, pooling, ...): refused naming the op,
#: where cupyfuse would compute
_NO_BOOL_OTHER = frozenset(set(_SHRINK_FUNCS) | {
    F.gelu, F.hardtanh, F.prelu, torch.prelu, F.rrelu,
    F.glu, F.softmin, torch.softmax, F.softmax, torch.log_softmax, F.log_softmax,
    F.max_pool1d, F.avg_pool1d, F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d,
    F.adaptive_max_pool1d, F.layer_norm, F.group_norm, F.normalize, F.instance_norm,
    F.batch_norm})


def no_bool_function(f: Any) -> bool:
    """Whether torch raises on a boolean first operand of function ``f``."""
    if f in _NO_BOOL_OTHER:
        return True
    op = op_of_function(f)
    return op is not None and op.kind in ("attr", "composite")


#: modules that take a boolean tensor in torch (anything else raises on one)
_BOOL_OK_MODULES = (nn.Identity, nn.Dropout, nn.Flatten)
#: binary functions refused by name (no record: torch's fmax/fmin ignore NaN)
_REFUSED_BINARY = (torch.fmax, torch.fmin)
_AUGMENTED = (operator.iadd, operator.isub, operator.imul, operator.itruediv)
_NUMBER_OPS = {operator.add: operator.add, operator.sub: operator.sub,
               operator.mul: operator.mul, operator.floordiv: operator.floordiv,
               operator.truediv: operator.truediv, operator.pow: operator.pow}
_IDENTITY_METHODS = {"clone", "detach", "contiguous", "float"}
_REDUCE_FUNCS: dict[Any, str] = {torch.sum: "sum", torch.mean: "mean", torch.amax: "amax",
                                 torch.amin: "amin", torch.max: "max", torch.min: "min",
                                 torch.logsumexp: "logsumexp", torch.norm: "norm",
                                 torch.linalg.vector_norm: "vector_norm", torch.var: "var",
                                 torch.std: "std", torch.argmax: "argmax",
                                 torch.argmin: "argmin"}
_REDUCE_METHODS = {"sum", "mean", "amax", "amin", "max", "min", "logsumexp", "norm", "var",
                   "std", "argmax", "argmin"}
#: the reductions giving positions (int64 in torch: ``_Index`` values)
_ARG_KINDS = ("argmax", "argmin")


#: what to write instead of a Linear applied per head
_PER_HEAD_HINT = ("a Linear per head is not fused: write it as one Linear of the whole row "
                  "(a block-diagonal weight over the flattened features), or fuse the model "
                  "up to the split")
#: tensors the forward makes (an in-place op on one, before anything reads it, is fused
#: as its out-of-place twin: Translator._check_inplace)
_FACTORY_FUNCS = frozenset({torch.zeros, torch.ones, torch.full, torch.zeros_like,
                            torch.ones_like, torch.full_like})
_FACTORY_METHODS = frozenset({"new_zeros", "new_ones", "new_full"})
#: ops on a (batch, C, L) value (1-D pooling over L within each channel, GroupNorm,
#: InstanceNorm): one translation for plain and split values (Translator.pool1d,
#: adaptive_pool1d, group_norm, instance_norm)
_CHANNEL_FUNCS = frozenset({F.max_pool1d, F.avg_pool1d, F.adaptive_avg_pool1d,
                            torch.adaptive_avg_pool1d, F.adaptive_max_pool1d, F.group_norm,
                            F.instance_norm, F.max_pool1d_with_indices,
                            F.adaptive_max_pool1d_with_indices})
_CHANNEL_MODULES = (nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d,
                    nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
#: elementwise ops besides the op table's (functions, methods, module types): on values
#: split into several dims they run on their operands laid out alike
#: (Translator._split_elementwise)
_EW_OTHER_FUNCS = (set(_SHRINK_FUNCS)
                   | {torch.where, F.gelu, F.hardtanh, torch.clamp,
                      torch.clip, torch.clamp_min, torch.clamp_max, F.rrelu, F.dropout,
                      F.alpha_dropout, F.feature_alpha_dropout, operator.invert,
                      torch.logical_not, operator.and_, torch.logical_and, operator.or_,
                      torch.logical_or, operator.xor, torch.logical_xor, torch.zeros_like,
                      torch.ones_like, torch.full_like, torch.clone, torch.detach})
_EW_OTHER_METHODS = (_IDENTITY_METHODS
                     | {"clamp", "clip", "clamp_", "clip_", "clamp_min", "clamp_min_",
                        "clamp_max", "clamp_max_", "masked_fill", "where", "logical_not",
                        "logical_and", "logical_or", "logical_xor", "to", "type", "bool"})
_EW_MODULES = (nn.Hardshrink, nn.Softshrink, nn.Threshold, nn.GELU, nn.LeakyReLU, nn.ELU,
               nn.Softplus, nn.Hardtanh, nn.Identity, nn.Dropout, nn.AlphaDropout,
               nn.FeatureAlphaDropout, nn.RReLU)


def elementwise_function(f: Any) -> bool:
    """Whether function ``f`` is elementwise (it runs on operands laid out alike)."""
    return f in _EW_OTHER_FUNCS or op_of_function(f) is not None


def elementwise_method(m: str) -> bool:
    """Whether tensor method ``m`` is elementwise."""
    return m in _EW_OTHER_METHODS or op_of_method(m) is not None


def elementwise_module(mod: Any) -> bool:
    """Whether module ``mod`` is elementwise."""
    return op_of_module(mod) is not None or isinstance(mod, _EW_MODULES)


def _arg(node_args: tuple, node_kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(node_args) > i:
        return node_args[i]
    return node_kwargs.get(name, default)


def _node_name(n: torch.fx.Node) -> str:
    """An fx node's op as messages name it: ``mul``, ``.t()``, ``fc (Linear)``."""
    if n.op == "call_method":
        return f".{n.target}()"
    if n.op == "call_module":
        return str(n.target)
    return getattr(n.target, "__name__", str(n.target))


def _is_expand(n: torch.fx.Node) -> bool:
    """Whether fx node ``n`` is an expand (translated for split values too)."""
    return n.op == "call_method" and n.target in ("expand", "expand_as") or \
        n.op == "call_function" and n.target is torch.broadcast_to
