"""The torch functions, methods and modules the translator (:mod:`cupyfuse.capture`)
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


#: ops that reorder a value's dims (_Translator._reorder): function -> its method's name
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


#: unary ops that keep an integer tensor integer in torch (the _BOOL_OK_UNARY ones give
#: float; any other raises)
_INT_KEEP_UNARY = frozenset({"abs", "neg", "square", "relu"})


_COMPARE: dict[Any, str] = {
    operator.gt: "gt", torch.gt: "gt", torch.greater: "gt", operator.lt: "lt", torch.lt: "lt",
    torch.less: "lt", operator.ge: "ge", torch.ge: "ge", torch.greater_equal: "ge",
    operator.le: "le", torch.le: "le", torch.less_equal: "le", operator.eq: "eq",
    torch.eq: "eq", operator.ne: "ne", torch.ne: "ne", torch.not_equal: "ne",
}
_COMPARE_METHODS = {"gt": "gt", "lt": "lt", "ge": "ge", "le": "le", "eq": "eq", "ne": "ne",
                    "greater": "gt", "less": "lt", "greater_equal": "ge", "less_equal": "le",
                    "not_equal": "ne"}


_UNARY_FUNCS: dict[Any, str] = {
    torch.relu: "relu", F.relu: "relu", torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid",
    torch.tanh: "tanh", F.tanh: "tanh", torch.exp: "exp", torch.log: "log",
    torch.log1p: "log1p", torch.abs: "abs", torch.sqrt: "sqrt", torch.rsqrt: "rsqrt",
    torch.square: "square", torch.neg: "neg", operator.neg: "neg", torch.reciprocal: "reciprocal",
    F.silu: "silu", F.mish: "mish", F.hardswish: "hardswish", F.hardsigmoid: "hardsigmoid",
    F.relu6: "relu6", torch.special.expit: "sigmoid", operator.abs: "abs",
    torch.erf: "erf", torch.special.erf: "erf", torch.sin: "sin", torch.cos: "cos",
    torch.expm1: "expm1", torch.special.expm1: "expm1", torch.log2: "log2",
    torch.atan: "atan", torch.arctan: "atan", torch.sinh: "sinh", torch.cosh: "cosh",
    torch.asinh: "asinh", torch.arcsinh: "asinh",
}
_UNARY_METHODS = {"relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh", "exp": "exp",
                  "log": "log", "log1p": "log1p", "abs": "abs", "sqrt": "sqrt", "rsqrt": "rsqrt",
                  "square": "square", "neg": "neg", "reciprocal": "reciprocal", "erf": "erf",
                  "sin": "sin", "cos": "cos", "expm1": "expm1", "log2": "log2",
                  "atan": "atan", "arctan": "atan", "sinh": "sinh", "cosh": "cosh",
                  "asinh": "asinh", "arcsinh": "asinh"}
_UNARY_MODULES: dict[type, str] = {
    nn.ReLU: "relu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.SiLU: "silu", nn.Mish: "mish",
    nn.Hardswish: "hardswish", nn.Hardsigmoid: "hardsigmoid", nn.ReLU6: "relu6",
}
#: activations composed of vocabulary ops (capture's ``composite``): function -> kind
_COMPOSITE_FUNCS: dict[Any, str] = {
    F.selu: "selu", torch.selu: "selu", F.celu: "celu", torch.celu: "celu",
    F.softsign: "softsign", F.tanhshrink: "tanhshrink", F.logsigmoid: "logsigmoid",
    torch._C._nn.log_sigmoid: "logsigmoid",
}
_COMPOSITE_MODULES: dict[type, str] = {
    nn.SELU: "selu", nn.CELU: "celu", nn.Softsign: "softsign", nn.Tanhshrink: "tanhshrink",
    nn.LogSigmoid: "logsigmoid",
}
_SHRINK_FUNCS: dict[Any, str] = {
    F.threshold: "threshold", torch.threshold: "threshold", F.hardshrink: "hardshrink",
    torch.hardshrink: "hardshrink", F.softshrink: "softshrink",
    torch._C._nn.softshrink: "softshrink",
}
# torch's SELU constants
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
#: unary ops torch computes on a boolean tensor (promoted to float); every other unary op
#: of the vocabulary raises there (abs, relu, silu, ...), and square gives int64
_BOOL_OK_UNARY = frozenset({"sigmoid", "tanh", "exp", "log", "log1p", "sqrt", "rsqrt",
                            "reciprocal", "erf", "sin", "cos", "expm1", "log2", "atan", "sinh",
                            "cosh", "asinh"})
#: functions torch raises on for a boolean first operand (activations, softmax, norms,
#: pooling, Linear forms): refused naming the op, where cupyfuse would compute
_NO_BOOL_FUNCS = frozenset(set(_COMPOSITE_FUNCS) | set(_SHRINK_FUNCS) | {
    F.gelu, F.leaky_relu, F.elu, F.softplus, F.hardtanh, F.prelu, torch.prelu, F.rrelu,
    F.glu, F.softmin, torch.softmax, F.softmax, torch.log_softmax, F.log_softmax,
    F.max_pool1d, F.avg_pool1d, F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d,
    F.adaptive_max_pool1d, F.layer_norm, F.group_norm, F.normalize, F.instance_norm,
    F.batch_norm})
#: modules that take a boolean tensor in torch (anything else raises on one)
_BOOL_OK_MODULES = (nn.Identity, nn.Dropout, nn.Flatten)
_BINARY_FUNCS: dict[Any, str] = {
    operator.add: "add", torch.add: "add", operator.sub: "sub", torch.sub: "sub",
    torch.subtract: "sub", operator.mul: "mul", torch.mul: "mul", torch.multiply: "mul",
    operator.truediv: "div", torch.div: "div", torch.divide: "div", torch.true_divide: "div",
    torch.maximum: "maximum", torch.minimum: "minimum", torch.fmax: None, torch.fmin: None,
    operator.pow: "pow", torch.pow: "pow", torch.hypot: "hypot", torch.atan2: "atan2",
    torch.arctan2: "atan2", torch.logaddexp: "logaddexp", torch.fmod: "fmod",
    operator.iadd: "add", operator.isub: "sub", operator.imul: "mul", operator.itruediv: "div",
}
_AUGMENTED = (operator.iadd, operator.isub, operator.imul, operator.itruediv)
_NUMBER_OPS = {operator.add: operator.add, operator.sub: operator.sub,
               operator.mul: operator.mul, operator.floordiv: operator.floordiv,
               operator.truediv: operator.truediv, operator.pow: operator.pow}
_BINARY_METHODS = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "pow": "pow",
                   "maximum": "maximum", "minimum": "minimum", "add_": "add", "sub_": "sub",
                   "mul_": "mul", "div_": "div", "true_divide": "div", "subtract": "sub",
                   "multiply": "mul", "divide": "div", "hypot": "hypot", "atan2": "atan2",
                   "arctan2": "atan2", "logaddexp": "logaddexp", "fmod": "fmod"}
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
#: as its out-of-place twin: _Translator._check_inplace)
_FACTORY_FUNCS = frozenset({torch.zeros, torch.ones, torch.full, torch.zeros_like,
                            torch.ones_like, torch.full_like})
_FACTORY_METHODS = frozenset({"new_zeros", "new_ones", "new_full"})
#: ops on a (batch, C, L) value (1-D pooling over L within each channel, GroupNorm,
#: InstanceNorm): one translation for plain and split values (_Translator.pool1d,
#: adaptive_pool1d, group_norm, instance_norm)
_CHANNEL_FUNCS = frozenset({F.max_pool1d, F.avg_pool1d, F.adaptive_avg_pool1d,
                            torch.adaptive_avg_pool1d, F.adaptive_max_pool1d, F.group_norm,
                            F.instance_norm, F.max_pool1d_with_indices,
                            F.adaptive_max_pool1d_with_indices})
_CHANNEL_MODULES = (nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d,
                    nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
#: elementwise ops (functions, methods, module types): on values split into several
#: dims they run on their operands laid out alike (_Translator._split_elementwise)
_EW_FUNCS = (set(_UNARY_FUNCS) | set(_COMPOSITE_FUNCS) | set(_SHRINK_FUNCS) | set(_COMPARE)
             | {f for f, op in _BINARY_FUNCS.items() if op is not None}
             | {torch.where, F.gelu, F.leaky_relu, F.elu, F.softplus, F.hardtanh, torch.clamp,
                torch.clip, torch.clamp_min, torch.clamp_max, F.rrelu, F.dropout,
                F.alpha_dropout, F.feature_alpha_dropout, operator.invert, torch.logical_not,
                operator.and_, torch.logical_and, operator.or_, torch.logical_or, operator.xor,
                torch.logical_xor, torch.zeros_like, torch.ones_like, torch.full_like,
                torch.clone, torch.detach})
_EW_METHODS = (set(_UNARY_METHODS) | {m + "_" for m in _UNARY_METHODS} | set(_BINARY_METHODS)
               | set(_COMPARE_METHODS) | _IDENTITY_METHODS
               | {"clamp", "clip", "clamp_", "clip_", "clamp_min", "clamp_min_", "clamp_max",
                  "clamp_max_", "masked_fill", "where", "logical_not", "logical_and",
                  "logical_or", "logical_xor", "to", "type", "bool"})
_EW_MODULES = (nn.Hardshrink, nn.Softshrink, nn.Threshold, nn.GELU, nn.LeakyReLU, nn.ELU,
               nn.Softplus, nn.Hardtanh, nn.Identity, nn.Dropout, nn.AlphaDropout,
               nn.FeatureAlphaDropout, nn.RReLU)


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
