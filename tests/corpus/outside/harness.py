"""Running one corpus model through cupyfuse and comparing it with the float64 eager model.

:func:`run_case` gives an :class:`Outcome`:

- ``match``: every output (and, in train mode, every floating buffer such as BatchNorm's
  running statistics) equals the float64 reference at atol = rtol = 1e-4, with NaN/inf
  where the reference has them, for every seed and batch;
- ``refused``: ``cupyfuse.TailError`` (``refusal_problem`` says whether its message names
  an op and a source line);
- ``mismatch``: it converted and gave a different answer (a silent wrong answer);
- ``error``: any other exception, or torch raised where the fused model returned.

The reference is a second instance built by ``make`` with the same seed, cast to float64
(no deepcopy: modules with the old ``weight_norm`` hook cannot be deep-copied). Where
torch itself raises (BatchNorm in training on one row) the fused model must raise too.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

import cupyfuse
from cupyfuse import TailError

from . import Case

ATOL = RTOL = 1e-4
SEEDS = (0, 1)


@dataclass
class Outcome:
    status: str                        # match / refused / mismatch / error
    err: float = 0.0                   # max |out - ref| / (atol + rtol |ref|) over finite elements
    message: str = ""
    details: list = field(default_factory=list)

    @property
    def first_line(self) -> str:
        return self.message.strip().splitlines()[0] if self.message.strip() else ""


def build(case: Case, seed: int, batch: int, cls: type | None = None) -> tuple:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = case.make(cls=cls or case.cls, batch=batch)
    return model, tuple(inputs)


def inputs_for(case: Case, seed: int, batch: int) -> tuple:
    return build(case, 7919 * seed + 31 * batch + 1, batch)[1]


def to64(inputs: tuple) -> tuple:
    return tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs)


def flatten(out: Any, path: str = "out") -> list[tuple[str, Any]]:
    if torch.is_tensor(out):
        return [(path, out)]
    if isinstance(out, dict):
        res = []
        for k in out:
            res += flatten(out[k], f"{path}[{k!r}]")
        return res
    if isinstance(out, (tuple, list)):
        res = []
        for i, o in enumerate(out):
            res += flatten(o, f"{path}[{i}]")
        return res
    return [(path, out)]


def structure(out: Any) -> Any:
    if torch.is_tensor(out):
        return "T"
    if isinstance(out, dict):
        return ("dict", tuple((k, structure(v)) for k, v in out.items()))
    if isinstance(out, (tuple, list)):
        return (type(out).__name__, tuple(structure(o) for o in out))
    return repr(out)


def scaled_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    fin = torch.isfinite(o) & torch.isfinite(r)
    if not bool(fin.any()):
        return 0.0
    return float(((o[fin] - r[fin]).abs() / (ATOL + RTOL * r[fin].abs())).max())


def compare(out: Any, ref: Any, what: str) -> tuple[float, list[str]]:
    """(max scaled error, problems) of ``out`` against the float64 ``ref``."""
    problems: list[str] = []
    if structure(out) != structure(ref):
        return float("inf"), [f"{what}: result structure {structure(out)} != torch's {structure(ref)}"]
    worst = 0.0
    for (path, o), (_, r) in zip(flatten(out), flatten(ref)):
        if not torch.is_tensor(r):
            if o != r:
                problems.append(f"{what} {path}: {o!r} != torch's {r!r}")
            continue
        if tuple(o.shape) != tuple(r.shape):
            problems.append(f"{what} {path}: shape {tuple(o.shape)} != torch's {tuple(r.shape)}")
            worst = float("inf")
            continue
        want = torch.float32 if r.dtype == torch.float64 else r.dtype
        if o.dtype != want:
            problems.append(f"{what} {path}: dtype {o.dtype}, torch gives {want}")
        if not r.is_floating_point():
            if not torch.equal(o.to(r.dtype), r):
                problems.append(f"{what} {path}: values differ from torch's")
            continue
        od, rd = o.double(), r.double()
        same_nan = torch.equal(torch.isnan(od), torch.isnan(rd))
        same_inf = torch.equal(torch.isposinf(od), torch.isposinf(rd)) and torch.equal(
            torch.isneginf(od), torch.isneginf(rd))
        if not (same_nan and same_inf):
            problems.append(f"{what} {path}: NaN/inf placement differs from the float64 reference "
                            f"({int(torch.isnan(od).sum())} NaN vs {int(torch.isnan(rd).sum())})")
        e = scaled_err(od, rd)
        worst = max(worst, e)
        if e > 1.0:
            problems.append(f"{what} {path}: max scaled error {e:.3g} "
                            f"(max |diff| {float((od - rd)[torch.isfinite(od - rd)].abs().max()):.3e})")
    return worst, problems


def float_buffers(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in m.named_buffers() if v.is_floating_point() or k.endswith("num_batches_tracked")}


_LINE = re.compile(r"\bat \S+:(\d+) in \w+(: (.*))?")


def refusal_problem(msg: str) -> str | None:
    """None when a TailError message names a source line (``at FILE:LINE in FUNC``) and an
    op: a name in backticks, a leading ``op:``, or the source text of the line; else what
    is missing."""
    m = _LINE.search(msg)
    if m is None:
        return "the message names no source line"
    first = msg.strip().splitlines()[0]
    if not (re.search(r"`[^`]+`", first) or re.match(r"\w+: [\w.]+:", first)
            or (m.group(3) or "").strip()):
        return "the message names no op"
    return None


def make_fused(case: Case, api: str, seed: int, batch: int, mode: str,
               device: str = "cpu") -> tuple:
    """(callable, module holding the state it updates), on ``device``."""
    if api == "from_model":
        model, _ = build(case, seed, batch)
        model.train(mode == "train")
        return cupyfuse.from_model(model.to(device)), model
    assert api == "fused_class"
    fm, _ = build(case, seed, batch, cls=cupyfuse.fused_class(case.cls))
    fm.train(mode == "train")
    return fm.to(device), fm


def to_device(inputs: tuple, device: str) -> tuple:
    return tuple(t.to(device) if torch.is_tensor(t) else t for t in inputs)


def to_cpu(out: Any) -> Any:
    if torch.is_tensor(out):
        return out.detach().cpu()
    if isinstance(out, dict):
        return {k: to_cpu(v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(to_cpu(o) for o in out)
    return out


def run_case(case: Case, mode: str, api: str = "from_model", seeds: tuple = SEEDS,
             batches: tuple | None = None, device: str = "cpu") -> Outcome:
    if batches is None:   # batch 1 in eval mode always (in train mode BatchNorm refuses it)
        batches = case.batches if mode == "train" or 1 in case.batches else (1,) + case.batches
    batches = tuple(batches)
    worst = 0.0
    details: list[str] = []
    for seed in seeds:
        ref_model, _ = build(case, seed, batches[0])
        ref_model.train(mode == "train")
        try:
            fused, owner = make_fused(case, api, seed, batches[0], mode, device)
        except TailError as e:
            return Outcome("refused", message=str(e))
        except Exception as e:   # noqa: BLE001 - any other exception is an error outcome
            return Outcome("error", message=f"building the fused model: {type(e).__name__}: {e}")
        if api == "fused_class":
            sd_ref, sd = ref_model.state_dict(), {k: v.cpu() for k, v in owner.state_dict().items()}
            if list(sd_ref) != list(sd) or not all(torch.equal(sd_ref[k], sd[k]) for k in sd):
                return Outcome("error", message="fused_class: the same seed gives other parameters "
                                                "or state_dict keys than the original class")
        ref_model.double()
        for batch in batches:
            inputs = inputs_for(case, seed, batch)
            what = f"{mode} seed {seed} batch {batch}"
            ref_exc = out = None
            try:
                with torch.no_grad():
                    ref = ref_model(*to64(inputs))
            except Exception as e:   # noqa: BLE001
                ref_exc = e
            try:
                with torch.no_grad():
                    out = to_cpu(fused(*to_device(inputs, device)))
            except TailError as e:
                if ref_exc is not None:
                    details.append(f"{what}: torch raised {type(ref_exc).__name__}, cupyfuse TailError")
                    continue
                return Outcome("refused", message=str(e))
            except Exception as e:   # noqa: BLE001
                if ref_exc is not None:
                    details.append(f"{what}: both raised ({type(ref_exc).__name__} / {type(e).__name__})")
                    continue
                return Outcome("error", message=f"{what}: {type(e).__name__}: {e}")
            if ref_exc is not None:
                return Outcome("error", message=f"{what}: torch raised {type(ref_exc).__name__}: "
                                                f"{ref_exc}, cupyfuse returned a result")
            e, problems = compare(out, ref, what)
            worst = max(worst, e)
            if mode == "train":
                rb = float_buffers(ref_model)
                fb = {k: v.cpu() for k, v in float_buffers(owner).items()}
                for k, rv in rb.items():
                    fv = fb.get(k)
                    if fv is None:
                        problems.append(f"{what}: buffer {k} missing")
                        continue
                    be = scaled_err(fv, rv) if rv.is_floating_point() else (
                        0.0 if torch.equal(fv.to(rv.dtype), rv) else float("inf"))
                    worst = max(worst, be)
                    if be > 1.0:
                        problems.append(f"{what}: buffer {k} after the call: scaled error {be:.3g}")
            if problems:
                return Outcome("mismatch", err=worst, message="\n".join(problems), details=details)
            if batch != batches[-1]:
                perturb(owner, ref_model, seed * 100 + batch)
    return Outcome("match", err=worst, details=details)


def perturb(owner: torch.nn.Module, ref_model: torch.nn.Module, seed: int) -> None:
    """An optimizer step between two calls: every floating parameter and buffer of the
    fused model's owner and of the float64 reference changed in place by the same amount
    (parameters shifted by about 5% of their mean magnitude, buffers scaled by a positive
    factor: running variances stay positive). Cached derived weights must follow."""
    g = torch.Generator().manual_seed(seed)
    mine = dict(owner.named_parameters())
    mine.update(owner.named_buffers())
    theirs = dict(ref_model.named_parameters())
    theirs.update(ref_model.named_buffers())
    params = {k for k, _ in ref_model.named_parameters()}
    with torch.no_grad():
        for k in sorted(theirs):
            r = theirs[k]
            if not r.is_floating_point() or k not in mine:
                continue
            if k in params:   # 5% of the tensor's mean magnitude (keeps its conditioning)
                d = torch.randn(r.shape, generator=g) * (0.05 * float(r.abs().mean()) + 1e-3)
                mine[k].add_(d.to(mine[k]))
                r.add_(d.to(r.dtype))
            else:
                f = 1 + 0.1 * torch.rand(r.shape, generator=g)
                mine[k].mul_(f.to(mine[k]))
                r.mul_(f.to(r.dtype))


def poison(inputs: tuple) -> tuple:
    """The first floating input with a NaN in its first row and +inf / -inf in later ones."""
    out = list(inputs)
    for i, t in enumerate(out):
        if torch.is_tensor(t) and t.is_floating_point():
            t = t.clone()
            flat = t.reshape(t.shape[0], -1)
            flat[0, 0] = float("nan")
            if t.shape[0] > 2:
                flat[1, -1] = float("inf")
                flat[2, flat.shape[1] // 2] = -float("inf")
            out[i] = flat.reshape(t.shape)
            break
    return tuple(out)


def run_nonfinite(case: Case, api: str = "from_model", seed: int = 0, device: str = "cpu",
                  batch: int | None = None) -> Outcome:
    """Eval mode (or the first mode), one batch of at least 3 rows with NaN/+inf/-inf in the
    first input: NaN/inf placement as PyTorch's float32 model on the same device, finite
    elements as the float64 model."""
    mode = "eval" if "eval" in case.modes else case.modes[0]
    batch = batch or max(max(case.batches), 3)
    m32, _ = build(case, seed, batch)
    m64, _ = build(case, seed, batch)
    m32.train(mode == "train")
    m64.train(mode == "train")
    m64.double()
    inputs = poison(inputs_for(case, seed, batch))
    try:
        fused, _ = make_fused(case, api, seed, batch, mode, device)
        with torch.no_grad():
            out = to_cpu(fused(*to_device(inputs, device)))
    except TailError as e:
        return Outcome("refused", message=str(e))
    except Exception as e:   # noqa: BLE001
        return Outcome("error", message=f"{type(e).__name__}: {e}")
    with torch.no_grad():   # PyTorch's float32 placement on the same device: torch's CPU
        # and CUDA kernels differ on some nonfinite inputs (CPU float32 F.gelu(+inf) is NaN)
        r32 = to_cpu(m32.to(device)(*to_device(inputs, device)))
        r64 = m64(*to64(inputs))
    problems = []
    worst = 0.0
    if structure(out) != structure(r32):
        return Outcome("mismatch", err=float("inf"), message="result structure differs")
    for (path, o), (_, a), (_, b) in zip(flatten(out), flatten(r32), flatten(r64)):
        if not (torch.is_tensor(a) and a.is_floating_point()):
            continue
        if tuple(o.shape) != tuple(a.shape):
            problems.append(f"{path}: shape {tuple(o.shape)} != {tuple(a.shape)}")
            continue
        for name, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
            if not torch.equal(fn(o), fn(a)):
                bad = (fn(o) != fn(a)).nonzero().tolist()[:4]
                problems.append(f"{path}: {name} placement differs from torch float32 at "
                                f"{int((fn(o) != fn(a)).sum())} elements, e.g. {bad}")
        fin = torch.isfinite(o) & torch.isfinite(a) & torch.isfinite(b)
        if bool(fin.any()):
            e = scaled_err(o[fin], b[fin])
            worst = max(worst, e)
            if e > 1.0:
                problems.append(f"{path}: finite elements: scaled error {e:.3g}")
    if problems:
        return Outcome("mismatch", err=worst, message="\n".join(problems))
    return Outcome("match", err=worst)
