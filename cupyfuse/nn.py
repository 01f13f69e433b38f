"""Fused ``nn.Module`` replacements for the four models, and converters.

Each class has the original's ``__init__`` signature, creates its parameters in the
original's order (the same seed gives the same weights) and has the same state_dict
keys, so ``fused.load_state_dict(original.state_dict())`` works. ``from_model(model)``
copies the Linear weight and bias (and scale, BatchNorm parameters and buffers) of an
original instance. :func:`from_model` picks the class by the model's structure, checked
against its traced forward when ``torch.fx`` can trace it.

The modules are forward-only (see :mod:`cupyfuse.interop`). Each has a ``precision``
attribute (None, "highest", "high", "medium"; see :mod:`cupyfuse.gemm`). The modules of
55, 56 and 98 call the named ops (one-line instances of :func:`cupyfuse.fused_linear`:
the generic tail programs) and replay repeated no-grad calls on the same input geometry
as a CUDA graph (``cuda_graphs`` attribute; see :mod:`cupyfuse.graphs`); 39's runs its
generic program at host-bound sizes and its own BatchNorm kernels above.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.nn as nn

from . import graphs, models, ops, plans
from .fused import FusedModel, fused_class

__all__ = [
    "FusedMatmulMaxPoolSumScale", "FusedMatmulSigmoidSum", "FusedMatmulAvgPoolGeluScaleMax",
    "FusedGemmScaleBatchNorm", "from_model", "fused_class", "FusedModel",
]


def _blank(cls: type, device: torch.device, *args: Any, **kwargs: Any) -> nn.Module:
    """An instance of ``cls`` with uninitialised storage on ``device`` (no costly init)."""
    with torch.device("meta"):
        m = cls(*args, **kwargs)
    return m.to_empty(device=device)


def _copy_into(dst: nn.Module, src_tensors: dict[str, torch.Tensor | None]) -> None:
    own = dict(dst.named_parameters())
    own.update(dict(dst.named_buffers()))
    with torch.no_grad():
        for name, val in src_tensors.items():
            if val is None:
                continue
            tgt = own[name]
            if tuple(tgt.shape) != tuple(val.shape):
                raise ValueError(f"from_model: {name} must be {tuple(tgt.shape)}, got {tuple(val.shape)}")
            tgt.copy_(val)


def _child(model: nn.Module, attr: str, kind: type) -> nn.Module:
    """``model.<attr>`` when it is a ``kind``, else the model's only child of that type."""
    m = getattr(model, attr, None)
    if isinstance(m, kind):
        return m
    found = [c for c in model.children() if isinstance(c, kind)]
    if len(found) != 1:
        raise ValueError(f"from_model: expected one {kind.__name__} in {type(model).__name__} "
                         f"(model.{attr}), found {len(found)}")
    return found[0]


def _linear(model: nn.Module, attr: str) -> nn.Linear:
    lin = _child(model, attr, nn.Linear)
    if lin.bias is None:
        raise ValueError("from_model: the Linear layer must have a bias (bias=True), like the original model")
    return lin


def _pool_size(pool: nn.Module) -> int:
    k = pool.kernel_size
    k = k[0] if isinstance(k, (tuple, list)) else k
    s = pool.stride
    s = s[0] if isinstance(s, (tuple, list)) else s
    pad = pool.padding
    pad = pad[0] if isinstance(pad, (tuple, list)) else pad
    if s != k or pad != 0 or getattr(pool, "ceil_mode", False) or getattr(pool, "dilation", 1) not in (1, (1,)):
        raise ValueError(f"from_model: only {type(pool).__name__}(kernel_size) with stride == kernel_size, "
                         f"no padding, no ceil_mode and no dilation is fused; got {pool}")
    return int(k)


class FusedMatmulMaxPoolSumScale(nn.Module):
    """Fused model 55. ``forward(x)``: (batch, in_features) -> (batch,)."""

    def __init__(self, in_features: int, out_features: int, kernel_size: int, scale_factor: float):
        super().__init__()
        self.precision: str | None = None  # GEMM precision; None follows torch's setting
        self.matmul = nn.Linear(in_features, out_features)
        self.max_pool = nn.MaxPool1d(kernel_size)
        self.kernel_size = plans.pool_size("MatmulMaxPoolSumScale", kernel_size)
        self.scale_factor = scale_factor
        self.cuda_graphs = True  # replay repeated calls as a CUDA graph (cupyfuse.graphs)
        self._graphs = graphs.GraphCache()

    def _eager(self, x: Any) -> Any:
        return ops.matmul_maxpool_sum_scale(x, self.matmul.weight, self.matmul.bias,
                                            self.kernel_size, self.scale_factor,
                                            precision=self.precision)

    def forward(self, x: Any) -> Any:
        hit = ops.small_batch_call("55", x, self.matmul.weight, self.matmul.bias,
                                   self.kernel_size, self.scale_factor, self.precision)
        if hit is not None:   # prepared launches (small/mid batches): no graph needed
            return hit
        if not self.cuda_graphs:
            return self._eager(x)
        return self._graphs.run(x, [self.matmul.weight, self.matmul.bias],
                                (self.kernel_size, self.scale_factor), self.precision, self._eager)

    @classmethod
    def from_model(cls, model: nn.Module) -> "FusedMatmulMaxPoolSumScale":
        lin = _linear(model, "matmul")
        k = _pool_size(_child(model, "max_pool", nn.MaxPool1d))
        new = _blank(cls, lin.weight.device, lin.in_features, lin.out_features, k, model.scale_factor)
        _copy_into(new, {"matmul.weight": lin.weight, "matmul.bias": lin.bias})
        return new.train(model.training)


class FusedMatmulSigmoidSum(nn.Module):
    """Fused model 56. ``forward(x)``: (batch, input_size) -> (batch, 1)."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.precision: str | None = None  # GEMM precision; None follows torch's setting
        self.linear = nn.Linear(input_size, hidden_size)
        self.cuda_graphs = True  # replay repeated calls as a CUDA graph (cupyfuse.graphs)
        self._graphs = graphs.GraphCache()

    def _eager(self, x: Any) -> Any:
        return ops.matmul_sigmoid_sum(x, self.linear.weight, self.linear.bias,
                                      precision=self.precision)

    def forward(self, x: Any) -> Any:
        hit = ops.small_batch_call("56", x, self.linear.weight, self.linear.bias,
                                   precision=self.precision)
        if hit is not None:   # prepared launches (small/mid batches): no graph needed
            return hit
        if not self.cuda_graphs:
            return self._eager(x)
        return self._graphs.run(x, [self.linear.weight, self.linear.bias], (), self.precision,
                                self._eager)

    @classmethod
    def from_model(cls, model: nn.Module) -> "FusedMatmulSigmoidSum":
        lin = _linear(model, "linear")
        new = _blank(cls, lin.weight.device, lin.in_features, lin.out_features)
        _copy_into(new, {"linear.weight": lin.weight, "linear.bias": lin.bias})
        return new.train(model.training)


class FusedMatmulAvgPoolGeluScaleMax(nn.Module):
    """Fused model 98. ``forward(x)``: (batch, in_features) -> (batch,)."""

    def __init__(self, in_features: int, out_features: int, pool_kernel_size: int,
                 scale_factor: float):
        super().__init__()
        self.precision: str | None = None  # GEMM precision; None follows torch's setting
        self.matmul = nn.Linear(in_features, out_features)
        self.avg_pool = nn.AvgPool1d(kernel_size=pool_kernel_size)
        self.pool_kernel_size = plans.pool_size("MatmulAvgPoolGeluScaleMax", pool_kernel_size)
        self.scale_factor = scale_factor
        self.cuda_graphs = True  # replay repeated calls as a CUDA graph (cupyfuse.graphs)
        self._graphs = graphs.GraphCache()

    def _eager(self, x: Any) -> Any:
        return ops.matmul_avgpool_gelu_scale_max(x, self.matmul.weight, self.matmul.bias,
                                                 self.pool_kernel_size, self.scale_factor,
                                                 precision=self.precision)

    def forward(self, x: Any) -> Any:
        hit = ops.small_batch_call("98", x, self.matmul.weight, self.matmul.bias,
                                   self.pool_kernel_size, self.scale_factor, self.precision)
        if hit is not None:   # prepared launches (small/mid batches): no graph needed
            return hit
        if not self.cuda_graphs:
            return self._eager(x)
        return self._graphs.run(x, [self.matmul.weight, self.matmul.bias],
                                (self.pool_kernel_size, self.scale_factor), self.precision,
                                self._eager)

    @classmethod
    def from_model(cls, model: nn.Module) -> "FusedMatmulAvgPoolGeluScaleMax":
        lin = _linear(model, "matmul")
        pool = _child(model, "avg_pool", nn.AvgPool1d)
        if not getattr(pool, "count_include_pad", True) or getattr(pool, "divisor_override", None):
            raise ValueError(f"from_model: unsupported AvgPool1d options in {pool}")
        k = _pool_size(pool)
        new = _blank(cls, lin.weight.device, lin.in_features, lin.out_features, k, model.scale_factor)
        _copy_into(new, {"matmul.weight": lin.weight, "matmul.bias": lin.bias})
        return new.train(model.training)




class FusedGemmScaleBatchNorm(nn.Module):
    """Fused model 39. ``forward(x)``: (batch, in_features) -> (batch, out_features).

    Honours ``train()``/``eval()`` like ``nn.BatchNorm1d``: training mode normalises with
    batch statistics and updates ``bn.running_mean``/``bn.running_var`` (momentum, or a
    cumulative average when ``bn.momentum`` is None) and ``bn.num_batches_tracked``.
    """

    def __init__(self, in_features: int, out_features: int, scale_shape: Any, eps: float = 1e-5,
                 momentum: float = 0.1):
        super().__init__()
        self.precision: str | None = None  # GEMM precision; None follows torch's setting
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)

    def _program_model(self) -> FusedModel:
        """The generic fused program of the original's forward over these very submodules
        (a plain model 39 sharing them, not registered: the state_dict is unchanged)."""
        lin, scale, bn = self.gemm, self.scale, self.bn
        gm = self.__dict__.get("_generic")
        if gm is None or gm[1] is not lin or gm[2] is not scale or gm[3] is not bn:
            shell = models.GemmScaleBatchNorm.__new__(models.GemmScaleBatchNorm)
            nn.Module.__init__(shell)
            shell.gemm, shell.scale, shell.bn = lin, scale, bn
            gm = (FusedModel(shell), lin, scale, bn)
            self.__dict__["_generic"] = gm
        gm[0].precision = self.precision
        return gm[0]

    def forward(self, x: Any) -> Any:
        # the BatchNorm's own mode decides (a frozen bn inside a training model keeps its
        # running statistics); the program counts the batch and updates the buffers
        return self._program_model()(x)

    @classmethod
    def from_model(cls, model: nn.Module) -> "FusedGemmScaleBatchNorm":
        lin = _linear(model, "gemm")
        bn = _child(model, "bn", nn.BatchNorm1d)
        scale = getattr(model, "scale", None)
        if not isinstance(scale, torch.Tensor):
            raise ValueError("from_model: expected a tensor model.scale")
        new = _blank(cls, lin.weight.device, lin.in_features, lin.out_features, tuple(scale.shape),
                     eps=bn.eps, momentum=bn.momentum)
        # Mirror the original BatchNorm's options (affine / running stats) exactly.
        new.bn = copy.deepcopy(bn)
        _copy_into(new, {"gemm.weight": lin.weight, "gemm.bias": lin.bias, "scale": scale})
        new.train(model.training)
        new.bn.train(bn.training)  # a frozen bn (model.train(); model.bn.eval()) stays frozen
        return new


# ---------------------------------------------------------------------------------
# Structure-based conversion
# ---------------------------------------------------------------------------------
_LAYOUT_OPS = {"unsqueeze", "squeeze", "view", "reshape", "contiguous", "float"}


def _expected_ops(cls: type, model: nn.Module) -> list[str]:
    """The data path of the original forward, as :func:`_traced_ops` spells it."""
    if cls is FusedMatmulSigmoidSum:
        return ["Linear", "sigmoid", "sum(dim=1,keepdim)"]
    if cls is FusedGemmScaleBatchNorm:
        return ["Linear", "mul(attr=scale)", "BatchNorm1d"]
    sf = getattr(model, "scale_factor", None)
    if isinstance(sf, bool) or not isinstance(sf, (int, float)):
        raise ValueError(f"from_model: expected a number model.scale_factor, got {sf!r}")
    if cls is FusedMatmulMaxPoolSumScale:
        return ["Linear", "MaxPool1d", "sum(dim=1)", f"mul(const={float(sf)!r})"]
    return ["Linear", "AvgPool1d", "gelu", f"mul(const={float(sf)!r})", "max(dim=1)",
            "getattr(values)"]


def _describe_node(node: Any, mods: dict) -> str | None:
    """Op plus the arguments that change its meaning; None for layout-only ops."""
    if node.op == "call_module":
        return type(mods[node.target]).__name__
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    if name in _LAYOUT_OPS:
        return None
    args, kwargs = list(node.args[1:]), dict(node.kwargs)
    if name in ("sum", "max", "amax", "mean", "min"):
        dim = kwargs.get("dim", args[0] if args else None)
        keep = kwargs.get("keepdim", args[1] if len(args) > 1 else False)
        if isinstance(dim, (tuple, list)) and len(dim) == 1:
            dim = dim[0]
        if dim == -1:  # the tail's tensors are 2-D: the last dim is dim 1
            dim = 1
        return f"{name}(dim={dim}{',keepdim' if keep else ''})"
    if name == "gelu":
        approx = kwargs.get("approximate", args[0] if args else "none")
        return "gelu" if approx == "none" else f"gelu(approximate={approx!r})"
    if name == "getattr":
        return f"getattr({args[0]})"
    if name == "getitem":
        return "getattr(values)" if args and args[0] == 0 else f"getitem({args[0] if args else ''})"
    if name == "mul":
        import torch.fx

        other = [a for a in node.args if not (isinstance(a, torch.fx.Node) and a.op != "get_attr")]
        if len(other) == 1 and isinstance(other[0], torch.fx.Node):
            return f"mul(attr={other[0].target})"
        if len(other) == 1 and isinstance(other[0], (int, float)) and not isinstance(other[0], bool):
            return f"mul(const={float(other[0])!r})"
        return "mul(?)"
    return name


def _traced_ops(model: nn.Module) -> list[str] | None:
    """The ops on the data path from the input to the output of ``model.forward``.

    Walks back from the output through each op's one data input (parameters read
    with get_attr are operands, not data), so unused branches don't count and a
    branch that mixes the input in twice is refused. None when fx cannot trace.
    """
    try:
        import torch.fx

        gm = torch.fx.symbolic_trace(model)
    except Exception:
        return None
    mods = dict(gm.named_modules())
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    node = out.args[0]
    chain = []
    while isinstance(node, torch.fx.Node) and node.op != "placeholder":
        chain.append(node)
        data = [a for a in node.args if isinstance(a, torch.fx.Node) and a.op != "get_attr"]
        if len(data) != 1:
            return ["<data path with %d inputs at %s>" % (len(data), node.name)]
        node = data[0]
    if len(placeholders) != 1 or node is not placeholders[0]:
        return ["<output not computed from the single input>"]
    seq = [_describe_node(n, mods) for n in reversed(chain)]
    return [d for d in seq if d is not None]


def _classify(model: nn.Module) -> type:
    kids = list(model.children())
    kinds = {type(k) for k in kids}
    lin = [k for k in kids if isinstance(k, nn.Linear)]
    if len(lin) != 1:
        raise ValueError(f"from_model: expected exactly one nn.Linear child, found {len(lin)} in "
                         f"{type(model).__name__}")
    if any(isinstance(k, nn.MaxPool1d) for k in kids) and len(kids) == 2:
        return FusedMatmulMaxPoolSumScale
    if any(isinstance(k, nn.AvgPool1d) for k in kids) and len(kids) == 2:
        return FusedMatmulAvgPoolGeluScaleMax
    if any(isinstance(k, nn.BatchNorm1d) for k in kids) and len(kids) == 2:
        return FusedGemmScaleBatchNorm
    if len(kids) == 1:
        return FusedMatmulSigmoidSum
    raise ValueError(f"from_model: {type(model).__name__} with children "
                     f"{sorted(t.__name__ for t in kinds)} matches none of the four fused models")


def from_model(model: nn.Module, precision: str | None = None) -> nn.Module:
    """Fused replacement for any Linear + tail model.

    An instance of one of the four original models (recognised by its children and
    checked against its traced forward) gets its named class (its weights copied
    to the model's device). Any other module whose forward is a Linear + tail (or a
    chain of them) gets a :class:`cupyfuse.fused.FusedModel` sharing the model's own
    parameters and buffers; an op outside the vocabulary raises
    :class:`cupyfuse.TailError` (a ``ValueError``) naming the op and its source line, at
    the first call (when the input shapes are known).
    """
    from . import fused

    fused_classes = (FusedMatmulMaxPoolSumScale, FusedMatmulSigmoidSum,
                     FusedMatmulAvgPoolGeluScaleMax, FusedGemmScaleBatchNorm)
    if isinstance(model, fused_classes):
        return copy.deepcopy(model)
    if isinstance(model, fused.FusedModel):
        return model
    try:
        cls = _classify(model)
        expected = _expected_ops(cls, model)
        seq = _traced_ops(model)
    except ValueError:
        seq, expected, cls = None, [], None
    if cls is not None and seq is None:
        warnings.warn(f"from_model: torch.fx could not trace {type(model).__name__}; converted "
                      f"by structure alone to {cls.__name__}", UserWarning, stacklevel=2)
        return cls.from_model(model)
    if cls is not None and seq == expected:
        try:
            out = cls.from_model(model)
        except ValueError:  # e.g. pooling the named class does not take
            return fused.from_model(model, precision)
        if precision is not None:
            out.precision = precision
        return out
    return fused.from_model(model, precision)
