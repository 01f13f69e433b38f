"""Derived weights: a Linear's weight or bias computed from the module's parameters and
buffers alone (``F.linear(x, self.w * 2.0)``, a pruning mask, a merged LoRA, a cosine
classifier's normalised weight, weight standardisation, ``x @ torch.t(self.w)``, a bias
``self.b * 2``). The translator lifts that part of the graph into a
``cupyfuse.ir.derived.Derived`` source evaluated with torch at each call and cached on the
tensors it reads (identity, version counter), so an in-place edit, ``load_state_dict`` or
a changed mask buffer is followed, and a rebound float attribute retraces. Each model
against a float64 copy of the eager one, on the CPU and (marked ``gpu``) on the GPU with
several calls per state (the prepared launches); random, in-place and other unsupported
forms are refused naming the op and its line.
"""
from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cupyfuse
from cupyfuse import from_model, fused_class
from cupyfuse.ir.derived import Derived
from cupyfuse.ir.program import TailError
from helpers import DEVICES
from helpers import program_of

THIS = __file__


def _check(fm, m, x, what, calls=3):
    """``calls`` calls of the fused model against a float64 copy of the eager one."""
    with torch.no_grad():
        ref = copy.deepcopy(m).cpu().double()(x.cpu().double())
        for c in range(calls):
            out = fm(x)
            assert out.dtype == torch.float32
            torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4,
                                       equal_nan=True, msg=lambda s: f"{what}, call {c}: {s}")


# --- the forms ------------------------------------------------------------------------
class Scaled(nn.Module):
    """A weight times a float attribute."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(24, 16) * 0.3)
        self.scale = 2.0

    def forward(self, x):
        return F.linear(x, self.w * self.scale).relu()


class ScaledByParam(nn.Module):
    """A learned 0-d scale and a per-row one (a buffer)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 24)
        self.g = nn.Parameter(torch.tensor(1.7))
        self.register_buffer("row", torch.rand(24, 1) + 0.5)

    def forward(self, x):
        return torch.tanh(F.linear(x, self.fc.weight * self.g * self.row, self.fc.bias))


class Masked(nn.Module):
    """A pruned Linear: a boolean mask buffer (its own weight kept dense)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 24)
        self.register_buffer("mask", torch.rand(24, 16) > 0.4)

    def forward(self, x):
        return F.gelu(F.linear(x, self.fc.weight * self.mask, self.fc.bias))


class MaskedFloat(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(24, 16) * 0.3)
        self.bias = nn.Parameter(torch.randn(24))
        self.register_buffer("mask", (torch.rand(24, 16) > 0.5).float())

    def forward(self, x):
        return F.silu(F.linear(x, self.weight * self.mask, self.bias)) * 2.0


class LoRA(nn.Module):
    """A merged LoRA adapter (peft's merged form)."""

    def __init__(self, r=4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(24, 16) * 0.3)
        self.bias = nn.Parameter(torch.randn(24) * 0.1)
        self.lora_A = nn.Parameter(torch.randn(r, 16) * 0.3)
        self.lora_B = nn.Parameter(torch.randn(24, r) * 0.3)
        self.scaling = 0.5

    def forward(self, x):
        w = self.weight + (self.lora_B @ self.lora_A) * self.scaling
        return F.linear(x, w, self.bias).softmax(-1)


class Cosine(nn.Module):
    """A cosine classifier: normalised features against normalised class weights."""

    def __init__(self, dim=-1):
        super().__init__()
        self.fc = nn.Linear(16, 24, bias=False)
        self.dim = dim
        self.s = 10.0

    def forward(self, x):
        return F.linear(F.normalize(x, dim=1), F.normalize(self.fc.weight, dim=self.dim)) * self.s


class CosineDim1(Cosine):
    def __init__(self):
        super().__init__(dim=1)


class WeightStd(nn.Module):
    """Weight standardisation (BiT's StdConv, as a Linear)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 24)
        self.eps = 1e-5

    def forward(self, x):
        w = self.fc.weight
        w = (w - w.mean(1, keepdim=True)) / (w.std(1, keepdim=True) + self.eps)
        return torch.logsumexp(F.linear(x, w, self.fc.bias), dim=1, keepdim=True)


class Transposes(nn.Module):
    """``x @ W.t()`` forms: a parameter's (an ordinary weight read transposed), torch.t of
    one, a scaled weight's .t() and .T, and a (K, N) weight used as it is."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(24, 16) * 0.3)
        self.v = nn.Parameter(torch.randn(16, 24) * 0.3)

    def forward(self, x):
        a = x @ self.w.t()
        b = x @ torch.t(self.w)
        c = x @ (self.w * 0.5).t()
        d = torch.matmul(x, (self.w * 2.0).T)
        e = x @ (self.v * 3.0)
        return a + b - c + d * e.sigmoid()


class DerivedBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(24, 16) * 0.3)
        self.b = nn.Parameter(torch.randn(24))
        self.log_s = nn.Parameter(torch.randn(24) * 0.1)

    def forward(self, x):
        return torch.sigmoid(F.linear(x, self.w, self.b * 2 + self.log_s.exp()))


class AddmmEinsum(nn.Module):
    """torch.addmm with a derived bias and weight, an einsum with a derived weight."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(24, 16) * 0.3)
        self.b = nn.Parameter(torch.randn(24))
        self.u = nn.Parameter(torch.randn(24, 16) * 0.3)

    def forward(self, x):
        h = torch.addmm(self.b * 0.5, x, (self.w - self.u).t())
        g = torch.einsum("bi,oi->bo", x, self.u.abs())
        return h * torch.tanh(g)


class TwoStages(nn.Module):
    """A chain of Linears, each with a derived weight; one tensor read by both."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 24)
        self.register_buffer("mask1", torch.rand(32, 16) > 0.3)
        self.temp = 0.7

    def forward(self, x):
        h = F.relu(F.linear(x, self.fc1.weight * self.mask1, self.fc1.bias))
        w2 = self.fc2.weight / self.temp
        return F.linear(h, w2, self.fc2.bias * (self.fc1.weight.abs().mean() + 1.0))


class DropConnectEval(nn.Module):
    """DropConnect's weight dropout, an identity in eval mode; an augmented assignment on
    a fresh value (fx records it out of place, as it computes)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 24)

    def forward(self, x):
        w = F.dropout(self.fc.weight, p=0.3, training=self.training)
        w = w * 1.0
        w *= 2.0
        return F.relu6(F.linear(x, w, self.fc.bias))


class SeqInput(nn.Module):
    """A (batch, seq, features) input through a derived weight."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 24)
        self.alpha = 0.25

    def forward(self, x):
        w = self.fc.weight + self.alpha * self.fc.weight.flip(0)
        return F.layer_norm(F.linear(x, w, self.fc.bias), (24,))


class WeightNormByHand(nn.Module):
    """Weight normalisation written out, and a max-norm constraint (torch.renorm)."""

    def __init__(self):
        super().__init__()
        self.v = nn.Parameter(torch.randn(24, 16))
        self.g = nn.Parameter(torch.rand(24, 1) + 0.5)
        self.u = nn.Parameter(torch.randn(24, 16))

    def forward(self, x):
        w = self.g * self.v / self.v.norm(dim=1, keepdim=True)
        return torch.tanh(F.linear(x, w)) + F.linear(x, torch.renorm(self.u, 2, 0, 1.0))


class RowsAndFactors(nn.Module):
    """Rows picked by an index buffer (a pruned layer), scaled by a shape read; a
    factorised weight ``x @ (A @ B)`` and its ``.T.contiguous()`` in F.linear; a
    ModuleList's weight masked."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 16))
        self.register_buffer("keep", torch.randperm(32)[:24])
        self.A = nn.Parameter(torch.randn(16, 4) * 0.5)
        self.B = nn.Parameter(torch.randn(4, 24) * 0.5)
        self.layers = nn.ModuleList([nn.Linear(16, 24)])
        self.register_buffer("mask", torch.rand(24, 16) > 0.5)

    def forward(self, x):
        a = F.linear(x, self.w[self.keep] * self.w.shape[1] ** -0.5)
        b = (x @ (self.A @ self.B)).relu() + F.linear(x, (self.A @ self.B).T.contiguous())
        c = F.linear(x, self.mask * self.layers[0].weight, self.layers[0].bias)
        return a * b.sigmoid() + c


class RBF(nn.Module):
    """Tensors the tail reads computed from a matrix alone (derived sources outside the
    GEMM's operands): an RBF head's squared distances written out, its centres' squared
    norms ``(self.centres ** 2).sum(1)`` added to the second GEMM's output."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 12)
        self.centres = nn.Parameter(torch.randn(10, 12) * 0.5)
        self.gamma = 0.05

    def forward(self, x):
        z = self.embed(x)
        d2 = (z ** 2).sum(1, keepdim=True) - 2 * z @ self.centres.t() + (self.centres ** 2).sum(1)
        return torch.exp(-self.gamma * d2)


class WeightStatsInTail(nn.Module):
    """A derived weight that the tail also reads reduced (``w.sum(1)``), a matrix's norm
    as a 0-d divisor and its rows' largest magnitudes as a per-feature offset."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(24, 16))
        self.fc = nn.Linear(16, 24)

    def forward(self, x):
        w = self.w * 2.0
        h = F.linear(x, w) + w.sum(1)
        return h + self.fc(x) / self.fc.weight.norm() + self.fc.weight.abs().amax(1)


FORMS = [Scaled, ScaledByParam, Masked, MaskedFloat, LoRA, Cosine, CosineDim1, WeightStd,
         Transposes, DerivedBias, AddmmEinsum, TwoStages, DropConnectEval, WeightNormByHand,
         RowsAndFactors, RBF, WeightStatsInTail]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", FORMS, ids=[c.__name__ for c in FORMS])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_derived_weights_match_float64(device, cls, seed):
    torch.manual_seed(seed)
    m = cls().eval().to(device)
    fm = from_model(m)
    for batch in (1, 9, 40):
        x = torch.randn(batch, 16, device=device) * 2
        _check(fm, m, x, f"{cls.__name__} batch {batch}")


@pytest.mark.parametrize("device", DEVICES)
def test_derived_weight_with_leading_dims(device):
    torch.manual_seed(3)
    m = SeqInput().to(device)
    _check(from_model(m), m, torch.randn(5, 7, 16, device=device), "seq")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_class_derived_weights(device, seed):
    torch.manual_seed(seed)
    m = LoRA().to(device)
    f = fused_class(LoRA)().to(device)
    f.load_state_dict(m.state_dict())
    _check(f, m, torch.randn(9, 16, device=device), "fused_class LoRA")


# --- following the model's state ----------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["from_model", "fused_class"])
def test_derived_weights_follow_state(device, how):
    torch.manual_seed(0)
    m = Masked().to(device)
    if how == "from_model":
        fm, target = from_model(m), m
    else:
        fm = fused_class(Masked)().to(device)
        fm.load_state_dict(m.state_dict())
        target = fm
    x = torch.randn(9, 16, device=device)
    _check(fm, m, x, "initial")

    def both(edit):
        edit(m)
        if target is not m:
            edit(target)

    with torch.no_grad():   # the parameter edited in place after the first calls
        both(lambda t: t.fc.weight.mul_(-1.5))
    _check(fm, m, x, "weight.mul_")
    with torch.no_grad():   # the mask buffer changed in place
        both(lambda t: t.mask[:, :5].logical_not_())
    _check(fm, m, x, "mask edited")
    sd = {k: (torch.randn_like(v) if v.is_floating_point() else torch.rand(v.shape) > 0.5)
          for k, v in m.state_dict().items()}
    both(lambda t: t.load_state_dict(sd))
    _check(fm, m, x, "load_state_dict")
    mask = torch.rand(24, 16, device=device) > 0.8
    both(lambda t: setattr(t, "mask", mask.clone()))   # the buffer rebound
    _check(fm, m, x, "mask rebound")
    w = torch.randn(24, 16, device=device)
    both(lambda t: setattr(t.fc, "weight", nn.Parameter(w.clone())))
    _check(fm, m, x, "weight rebound")


@pytest.mark.parametrize("device", DEVICES)
def test_float_attribute_rebound_retraces(device):
    torch.manual_seed(1)
    m = Scaled().to(device)
    fm = from_model(m)
    x = torch.randn(9, 16, device=device)
    _check(fm, m, x, "scale 2.0")
    for s in (-0.5, 3, 0.0, -0.0, 2.0):
        m.scale = s
        _check(fm, m, x, f"scale {s!r}")
    m = LoRA().to(device)
    fm = from_model(m)
    _check(fm, m, x, "LoRA")
    m.scaling = 2.0
    _check(fm, m, x, "LoRA scaling 2.0")
    with torch.no_grad():
        m.lora_B.zero_()   # (peft's initial B)
    _check(fm, m, x, "LoRA B zeroed")


@pytest.mark.parametrize("device", DEVICES)
def test_zero_d_scale_parameter_edited(device):
    torch.manual_seed(2)
    m = ScaledByParam().to(device)
    fm = from_model(m)
    x = torch.randn(9, 16, device=device)
    _check(fm, m, x, "initial")
    with torch.no_grad():
        m.g.fill_(-0.25)
        m.row[3] = 7.0
    _check(fm, m, x, "g and row edited")


@pytest.mark.parametrize("device", DEVICES)
def test_same_tensor_while_unchanged(device, monkeypatch):
    """The derived tensor is evaluated once per change of the tensors it reads and is the
    same object in between (the engine caches its split of the weight on it)."""
    torch.manual_seed(0)
    m = LoRA().to(device)
    fm = from_model(m)
    x = torch.randn(9, 16, device=device)
    prog = program_of(fm, x)
    ders = [s for s in prog.sources if isinstance(s, Derived)]
    assert len(ders) == 1 and ders[0].shape == (24, 16)
    d = ders[0]
    runs = []
    real = Derived.evaluate
    monkeypatch.setattr(Derived, "evaluate", lambda self, leaves: runs.append(1) or
                        real(self, leaves))
    first = d.value(m)
    assert d.value(m) is first
    _check(fm, m, x, "cached", calls=4)
    assert d.value(m) is first and len(runs) <= 1
    with torch.no_grad():
        m.lora_A.add_(0.5)
    second = d.value(m)
    assert second is not first and d.value(m) is second
    _check(fm, m, x, "after lora_A.add_", calls=3)
    assert d.value(m) is second
    n = len(runs)
    # a write through .data bypasses the version counter; the fused module's tensors
    # count it (cupyfuse.tracking)
    m.lora_A.data.mul_(2.0)
    assert d.value(m) is not second and len(runs) == n + 1
    _check(fm, m, x, "after a .data write")


def test_derived_sources_compare_by_computation():
    torch.manual_seed(0)
    m = Scaled()
    x = torch.randn(3, 16)
    a = program_of(from_model(m), x).sources[0]
    b = program_of(from_model(m), x).sources[0]
    assert isinstance(a, Derived) and a is not b and a == b and hash(a) == hash(b)
    m.scale = 3.0
    c = program_of(from_model(m), x).sources[0]
    assert c != a
    assert "Scaled" not in repr(a) and "forward" in repr(a)   # where it is computed


def test_derived_leaves_get_gradients():
    m = Scaled()
    fm = from_model(m)
    x = torch.randn(3, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fm(x)
        with torch.no_grad():
            assert fm(x).grad_fn is None
    assert out.grad_fn is not None
    out.sum().backward()
    ref = copy.deepcopy(m).double()
    ref(x.double()).sum().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.double(), q.grad, atol=1e-4, rtol=1e-4)


def test_leaf_on_another_dtype_is_refused_at_call():
    """A float buffer a derived weight reads, turned float64 after tracing, is refused at
    the call (the program's key holds shapes, not dtypes)."""
    m = MaskedFloat()
    fm = from_model(m)
    x = torch.randn(3, 16)
    with torch.no_grad():
        fm(x)
        m.mask = m.mask.double()
        with pytest.raises(TypeError, match="must be float32"):
            fm(x)


# --- refusals -------------------------------------------------------------------------
class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(24, 16))
        self.act = nn.Tanh()


class RandomNoise(_Base):
    def forward(self, x):
        return F.linear(x, self.w + 0.01 * torch.randn_like(self.w))


class ActiveDropConnect(_Base):
    def forward(self, x):
        return F.linear(x, F.dropout(self.w, 0.5, training=True))


class InPlaceOnCopy(_Base):
    def forward(self, x):
        w = self.w * 2.0
        w.mul_(3.0)
        return F.linear(x, w)


class InPlaceResult(_Base):
    def forward(self, x):
        return F.linear(x, self.w.clone().clamp_(-1.0, 1.0))


class AugmentedOnParameter(_Base):
    def forward(self, x):
        w = self.w
        w *= 2.0
        return F.linear(x, w)


class ModuleOnWeight(_Base):
    def forward(self, x):
        return F.linear(x, self.act(self.w))


class CumsumWeight(_Base):
    def forward(self, x):
        return F.linear(x, torch.cumsum(self.w, 1))


class SortedWeight(_Base):
    def forward(self, x):
        return F.linear(x, self.w.sort(1)[0])


class MatrixInTail(_Base):
    def forward(self, x):
        w = self.w * 2.0
        return F.linear(x, w).unsqueeze(-1) * w


class ShapeMismatch(_Base):
    def forward(self, x):
        return F.linear(x, self.w.t() * 2.0)


REFUSALS = [
    (RandomNoise, "randn_like", "random in a Linear's weight or bias",
     "self.w + 0.01 * torch.randn_like(self.w)"),
    (ActiveDropConnect, "dropout", "random in a Linear's weight or bias",
     "F.dropout(self.w, 0.5, training=True)"),
    (InPlaceOnCopy, ".mul_()", "an in-place op on a value that a Linear's weight",
     "w.mul_(3.0)"),
    (InPlaceResult, ".clamp_()", "an in-place op in a Linear's weight", "clamp_(-1.0, 1.0)"),
    (AugmentedOnParameter, "mul", "an in-place update of the module's tensor `w`",
     "w *= 2.0"),
    (ModuleOnWeight, "act (Tanh)", "a module called in a Linear's weight",
     "self.act(self.w)"),
    (CumsumWeight, "cumsum", "not evaluated in a Linear's weight", "torch.cumsum(self.w, 1)"),
    (SortedWeight, ".sort()", "not evaluated in a Linear's weight", "self.w.sort(1)[0]"),
    (MatrixInTail, "mul", "uses a matrix parameter outside a matmul",
     "F.linear(x, w).unsqueeze(-1) * w"),
]


def _line_of(cls, code):
    lines, start = inspect.getsourcelines(cls.forward)
    hits = [start + i for i, ln in enumerate(lines) if code in ln]
    assert len(hits) == 1, (cls.__name__, code, hits)
    return hits[0]


@pytest.mark.parametrize("cls,op,why,code", REFUSALS, ids=[c[0].__name__ for c in REFUSALS])
def test_refusals_name_the_op_and_line(cls, op, why, code):
    torch.manual_seed(0)
    m = cls()
    x = torch.randn(4, 16)
    with pytest.raises(TailError) as ei:
        with torch.no_grad():
            from_model(m)(x)
    msg = str(ei.value)
    assert msg.startswith(f"{cls.__name__}: "), msg
    assert f"`{op}`" in msg, msg
    assert why in msg, msg
    assert f"{THIS}:{_line_of(cls, code)} in forward" in msg, msg
    assert code in msg, msg


def test_torch_error_of_the_weight_is_refused():
    """A derived weight torch cannot compute (shapes) is refused at translation with
    torch's message, as eager raises at its call."""
    m = ShapeMismatch()
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError):
        m(x)
    with pytest.raises(TailError, match=r"F\.linear|linear|expects 16 input features"):
        from_model(m)(x)


def test_float64_weight_refused():
    class Double(_Base):
        def forward(self, x):
            return F.linear(x, self.w.to(torch.float64))

    with pytest.raises(TailError, match=r"`\.to\(\)`: a Linear's weight or bias computed "
                                        r"as torch\.float64 \(cupyfuse runs float32\)"):
        from_model(Double())(torch.randn(3, 16))


def test_derived_weight_in_place_edit_in_forward_refused():
    """An in-place update of the module's tensor itself, read by a derived weight."""

    class Decay(_Base):
        def forward(self, x):
            self.w.mul_(0.99)
            return F.linear(x, self.w * 2.0)

    with pytest.raises(TailError, match=r"in-place|mul_"):
        from_model(Decay())(torch.randn(3, 16))


def test_plain_tensor_attribute_changing_shape_is_an_error():
    """Parameters' and buffers' shapes key the program; a tensor held as a plain
    attribute is read per call, and a derived weight of another shape than traced is an
    error naming it (eager fails there too: x's features no longer match)."""

    class Extra(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(24, 12))
            self.extra = torch.randn(24, 4)

        def forward(self, x):
            return F.linear(x, torch.cat([self.w, self.extra], 1))

    m = Extra()
    fm = from_model(m)
    x = torch.randn(3, 16)
    with torch.no_grad():
        _check(fm, m, x, "traced")
        m.extra = torch.randn(24, 4)   # same shape, another tensor: followed
        _check(fm, m, x, "extra rebound")
        m.extra = torch.randn(24, 8)
        with pytest.raises(RuntimeError, match=r"\(w, extra\) is now \(24, 20\), \(24, 16\) "
                                               r"when traced: its shape must follow.*register it as a buffer"):
            fm(x)


class Temperature(nn.Module):
    """A number passed to the forward (a constant of the program, one per value) in a
    derived weight and bias; its default too."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 24)

    def forward(self, x, t=1.0):
        return torch.log_softmax(F.linear(x, self.fc.weight / t, self.fc.bias * t), dim=1)


@pytest.mark.parametrize("device", DEVICES)
def test_number_argument_in_derived_weight(device):
    torch.manual_seed(4)
    m = Temperature().to(device)
    fm = from_model(m)
    x = torch.randn(9, 16, device=device)
    with torch.no_grad():
        for t in (0.5, 2, 0.5, None):
            args = (x,) if t is None else (x, t)
            ref = copy.deepcopy(m).cpu().double()(*[a.cpu().double() if torch.is_tensor(a)
                                                      else a for a in args])
            for _ in range(2):
                torch.testing.assert_close(fm(*args).cpu().double(), ref, atol=1e-4,
                                           rtol=1e-4, msg=lambda s: f"t={t}: {s}")


@pytest.mark.parametrize("device", DEVICES)
def test_tail_tensors_follow_state(device):
    """A tensor the tail reads computed from a matrix (RBF's centres' squared norms)
    follows an in-place edit and load_state_dict, as derived weights do."""
    torch.manual_seed(4)
    m = RBF().to(device)
    fm = from_model(m)
    x = torch.randn(9, 16, device=device)
    _check(fm, m, x, "initial")
    with torch.no_grad():
        m.centres.mul_(1.5)
    _check(fm, m, x, "centres.mul_")
    m.load_state_dict({k: torch.randn_like(v) * 0.5 for k, v in m.state_dict().items()})
    _check(fm, m, x, "load_state_dict")


def test_tail_tensor_refusals_name_it():
    """A random op or a module call in a tensor the tail reads is refused as such."""
    class Noisy(_Base):
        def forward(self, x):
            return F.linear(x, self.w) + torch.randn_like(self.w).sum(1)

    class Called(_Base):
        def forward(self, x):
            return F.linear(x, self.w) + self.act(self.w).sum(1)

    for cls, why in ((Noisy, "random in a tensor the tail reads"),
                     (Called, "a module called in a tensor the tail reads")):
        with pytest.raises(TailError, match=why):
            from_model(cls())(torch.randn(3, 16))


class _TailOf(nn.Module):
    """A Linear and a (6, 4) matrix whose derived tensors the tail reads (the forms
    below; each converts)."""

    FORM = ""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 6)
        self.W = nn.Parameter(torch.randn(6, 4))
        self.ln = nn.LayerNorm(6)

    def forward(self, x):
        h = self.fc(x)
        f = self.FORM
        if f == "unsqueeze":
            return h * self.W.sum(1).unsqueeze(0)
        if f == "softmax":
            return h + torch.softmax(self.W.sum(1), 0)
        if f == "scalar":
            return h / self.W.abs().max()
        if f == "transposed":
            return h + self.W.t().sum(0).sum() + self.W.T.sum(0).mean()
        if f == "stack":
            return h + torch.stack([self.W.sum(1), self.W.mean(1)]).sum(0)
        if f == "module":
            return h + self.ln(self.W.sum(1))
        if f == "bool":
            return torch.where(self.W.sum(1) > 0, h, -h)
        raise AssertionError(f)


def _tail_of(form: str) -> type:
    return type(f"TailOf_{form}", (_TailOf,), {"FORM": form})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["unsqueeze", "softmax", "scalar", "transposed", "stack"])
def test_tail_tensor_forms_match_float64(device, form):
    torch.manual_seed(6)
    m = _tail_of(form)().to(device)
    fm = from_model(m)
    _check(fm, m, torch.randn(7, 16, device=device), form)
    _check(fm, m, _poisoned(torch.randn(5, 16, device=device)), f"{form}, NaN/inf rows")


@pytest.mark.parametrize("form,why", [
    ("module", "a module called in a tensor the tail reads"),
    ("bool", "a tensor the tail reads computed as torch.bool")])
def test_tail_tensor_forms_refused(form, why):
    with pytest.raises(TailError, match=why):
        from_model(_tail_of(form)())(torch.randn(3, 16))


def _poisoned(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, 0] = float("nan")
    x[1, 3] = float("inf")
    return x
