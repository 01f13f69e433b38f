"""``python -m cupyfuse bench``: check and time the four fused models against PyTorch.

For each selected problem and size:

1. **Correctness** (PROBLEMS.md protocol): the original model (``cupyfuse.kernelbench.models``) is
   built on the device, converted with :func:`cupyfuse.from_model` (of a deep copy), and compared over
   several seeds and two input distributions (``torch.rand`` as in the benchmark, and
   ``torch.randn * 3``, which spreads the Linear outputs so sigmoid/GELU saturate and
   the pair-difference trick sees both signs) with a float64 reference: a deep copy of
   the original converted to ``.double()`` run on ``x.double()`` (on the GPU when there
   is one). Model 39 is compared in the original's mode (training by default), the
   reference starting from the fused module's running statistics on every trial, and
   the updated running statistics are compared too. Pass = ``torch.allclose(out, ref,
   atol=1e-4, rtol=1e-4)`` on every trial.
2. **Timing** (GPU only): median ms of PyTorch eager fp32 (TF32 off), ``torch.compile``
   of the original (unless ``--no-compile``) and the fused module, under
   ``torch.no_grad()``, with ``triton.testing.do_bench`` when Triton imports, else a
   CUDA-event loop. Speedups and the percentage of the fp32-accurate floor follow.

Without a GPU the CPU path of the fused ops is checked at size ``"small"`` and the
timing columns read ``-``. The exit code is 0 when every correctness check passed.
"""
from __future__ import annotations

import copy
import datetime as _dt
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, TextIO

import torch

__all__ = [
    "FLOORS_MS", "ATOL", "RTOL", "DISTRIBUTIONS", "BenchOptions", "Progress",
    "gpu_available", "select_cases", "compare", "check_correctness", "time_ms",
    "run_bench", "format_table", "write_plot",
]

# fp32-accurate floors in ms, from shared/PERF.md ("Floors and targets"), measured on an
# H100 80GB HBM3 SXM: floor = max(bytes moved / 3.0 TB/s, 3 x FLOP / 400 TFLOP/s) after
# the exact algebra. Keyed by (problem, size). Other devices: the percentage is indicative.
FLOORS_MS: dict[tuple[str, str], float] = {
    ("55", "kernelbench"): 1.03,
    ("56", "kernelbench"): 2.06,
    ("98", "kernelbench"): 0.064,
    ("39", "kernelbench"): 4.12,
    ("39", "seed"): 1.03,
}
FLOOR_DEVICE = "H100 80GB HBM3 SXM"

# KernelBench's current tolerance (PROBLEMS.md, "Correctness protocol").
ATOL = 1e-4
RTOL = 1e-4
# Elements whose |reference| is at most this are left out of the elementwise relative error.
ELEM_REL_FLOOR = 1e-3

ALL_PROBLEMS = ("55", "56", "98", "39")
ALL_SIZES = ("kernelbench", "seed", "small")
DEFAULT_GPU_SIZES = ("kernelbench", "seed")
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_REPS = 100
MODEL_SEED = 0  # torch seed the original model is built under (same weights every run)


def _rand(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.rand(shape, generator=gen, device=device)


def _randn3(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device) * 3.0


# name -> (shape, generator, device) -> float32 input. "rand" is the benchmark's own.
DISTRIBUTIONS: dict[str, Callable[[tuple[int, ...], torch.Generator, torch.device], torch.Tensor]] = {
    "rand": _rand,
    "randn*3": _randn3,
}


# ---------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------
def gpu_available() -> tuple[bool, str]:
    """(True, "") when torch and CuPy both see a CUDA device, else (False, why not)."""
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    try:
        from cupyfuse.interop import cupy_available

        if not cupy_available():
            return False, "CuPy sees no CUDA device"
    except Exception as exc:  # pragma: no cover - depends on the install
        return False, f"CuPy is not usable ({exc.__class__.__name__}: {exc})"
    return True, ""


def _triton_do_bench() -> Callable[..., Any] | None:
    try:
        from triton.testing import do_bench
    except Exception:
        return None
    return do_bench


def _versions() -> dict[str, Any]:
    from cupyfuse import __version__, info

    out: dict[str, Any] = {"cupyfuse": __version__, "torch": torch.__version__,
                           "python": platform.python_version()}
    try:
        inf = info()
    except Exception as exc:  # report, never die on a header
        inf = {"info_error": f"{exc.__class__.__name__}: {exc}"}
    out["cupy"] = inf.get("cupy", "?")
    out["gemm_engine"] = inf.get("gemm_engine", "?")
    out["info"] = inf
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:
        out["triton"] = None
    return out


# ---------------------------------------------------------------------------------
# Progress bar (stderr only, so it never mixes into the table on stdout)
# ---------------------------------------------------------------------------------
class Progress:
    """A one-line progress bar on a terminal; one line per step otherwise.

    On a TTY the bar is redrawn in place with ``\\r`` and erased by :meth:`close`, so
    nothing of it is left when the table is printed. :meth:`message` prints a line
    above the bar (warnings, skipped cases).
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24,
                 enabled: bool = True) -> None:
        self.total = max(1, int(total))
        self.done = 0
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.enabled = enabled
        try:
            self.tty = bool(self.stream.isatty())
        except Exception:
            self.tty = False
        self._shown = 0  # characters of the bar currently on the terminal line
        self._label = ""
        self._t0 = time.monotonic()

    def _bar(self) -> str:
        frac = min(1.0, self.done / self.total)
        filled = int(round(frac * self.width))
        elapsed = time.monotonic() - self._t0
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{elapsed:5.0f}s  {self._label}")

    def _erase(self) -> None:
        if self.tty and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self._shown = 0

    def _draw(self) -> None:
        if not self.enabled:
            return
        line = self._bar()
        if self.tty:
            self._erase()
            cols = _terminal_columns()
            if len(line) > cols - 1:
                line = line[: max(10, cols - 1)]
            self.stream.write(line)
            self._shown = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def step(self, label: str) -> None:
        """Start step ``label`` (the previous one counts as done)."""
        if self._label:
            self.done = min(self.total, self.done + 1)
        self._label = label
        self._draw()

    def message(self, text: str) -> None:
        if self.tty:
            self._erase()
        self.stream.write(text + "\n")
        self.stream.flush()
        if self.tty and self.enabled and self._label:
            self._draw()

    def close(self) -> None:
        if self._label:
            self.done = self.total
        if self.tty:
            self._erase()
        self._label = ""
        try:
            self.stream.flush()
        except Exception:
            pass


def _terminal_columns() -> int:
    try:
        cols = os.get_terminal_size(sys.stderr.fileno()).columns
    except Exception:
        return 100
    return cols if cols >= 40 else 100  # 0 or tiny: a pseudo-terminal without a size


# ---------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------
def _split(text: str | None) -> list[str]:
    if text is None:
        return []
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_problems(text: str | None) -> list[str]:
    from cupyfuse.kernelbench.models import PROBLEMS

    if text is None:
        return list(ALL_PROBLEMS)
    out = []
    for p in _split(text):
        if p not in PROBLEMS:
            raise ValueError(f"unknown problem {p!r} (choose from {', '.join(ALL_PROBLEMS)})")
        if p not in out:
            out.append(p)
    if not out:
        raise ValueError("--problems is empty")
    return out


def parse_sizes(text: str | None) -> list[str] | None:
    if text is None:
        return None
    out = []
    for s in _split(text):
        if s not in ALL_SIZES:
            raise ValueError(f"unknown size {s!r} (choose from {', '.join(ALL_SIZES)})")
        if s not in out:
            out.append(s)
    if not out:
        raise ValueError("--sizes is empty")
    return out


def parse_seeds(text: str | None) -> list[int]:
    if text is None:
        return list(DEFAULT_SEEDS)
    try:
        seeds = [int(s) for s in _split(text)]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ValueError("--seeds is empty")
    return seeds


def select_cases(problems: Sequence[str], sizes: Sequence[str], explicit_sizes: bool,
                 note: Callable[[str], None] | None = None) -> list[tuple[str, str]]:
    """(problem, size) pairs that exist, problem-major. A missing pair is skipped,
    with a note when the user named the size explicitly."""
    from cupyfuse.kernelbench.models import PROBLEMS

    cases = []
    for p in problems:
        have = PROBLEMS[p].sizes
        for s in sizes:
            if s in have:
                cases.append((p, s))
            elif explicit_sizes and note is not None:
                note(f"skipping {p}/{s}: problem {p} has no size {s!r} "
                     f"(it has {', '.join(have)})")
    return cases


# ---------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------
def _f(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _worst(values: Sequence[float]) -> float | None:
    """Largest value; NaN if any is NaN (a NaN error must never look small)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    if any(math.isnan(v) for v in vals):
        return float("nan")
    return max(vals)


def compare(out: Any, ref: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> dict[str, Any]:
    """Compare a float32 result with a float64 reference.

    Returns ``allclose`` and the errors: ``max_abs_err``, ``rel_err`` =
    ||out - ref|| / ||ref||, ``max_elem_rel_err`` over elements with |ref| > 1e-3, and
    ``nonfinite`` (count of NaN/inf in ``out`` where ``ref`` is finite).
    """
    if not isinstance(out, torch.Tensor):
        out = torch.as_tensor(out)
    res: dict[str, Any] = {"allclose": False, "max_abs_err": float("nan"),
                           "rel_err": float("nan"), "max_elem_rel_err": float("nan"),
                           "nonfinite": None}
    if tuple(out.shape) != tuple(ref.shape):
        res["error"] = f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
        return res
    if out.dtype != torch.float32:
        res["error"] = f"dtype {out.dtype}, expected torch.float32"
    o = out.detach().to(device=ref.device, dtype=torch.float64)
    diff = o - ref
    res["allclose"] = bool(torch.allclose(o, ref, atol=atol, rtol=rtol)) and "error" not in res
    res["nonfinite"] = int((~torch.isfinite(o) & torch.isfinite(ref)).sum().item())
    if diff.numel() == 0:
        res.update(max_abs_err=0.0, rel_err=0.0, max_elem_rel_err=0.0)
        return res
    adiff = diff.abs()
    # torch.max propagates NaN, so a NaN anywhere shows up as a NaN error.
    res["max_abs_err"] = _f(adiff.max())
    ref_norm = _f(torch.linalg.vector_norm(ref))
    res["rel_err"] = _f(torch.linalg.vector_norm(diff)) / max(ref_norm, 1e-300)
    mask = ref.abs() > ELEM_REL_FLOOR
    if bool(mask.any()):
        res["max_elem_rel_err"] = _f((adiff[mask] / ref.abs()[mask]).max())
    else:
        res["max_elem_rel_err"] = 0.0
    return res


def _bn_of(model: torch.nn.Module) -> torch.nn.BatchNorm1d | None:
    bn = getattr(model, "bn", None)
    return bn if isinstance(bn, torch.nn.modules.batchnorm._BatchNorm) else None


def _copy_bn_buffers(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Make ``dst``'s BatchNorm buffers equal ``src``'s (dtype of ``dst`` kept)."""
    s, d = _bn_of(src), _bn_of(dst)
    if s is None or d is None:
        return
    with torch.no_grad():
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            a, b = getattr(s, name, None), getattr(d, name, None)
            if a is not None and b is not None:
                b.copy_(a)


def _compare_bn_buffers(fused: torch.nn.Module, ref: torch.nn.Module) -> dict[str, Any]:
    f, r = _bn_of(fused), _bn_of(ref)
    if f is None or r is None or f.running_mean is None or r.running_mean is None:
        return {}
    errs = {}
    ok = True
    for name in ("running_mean", "running_var"):
        a = getattr(f, name).detach().double()
        b = getattr(r, name).detach().double().to(a.device)
        ok = ok and bool(torch.allclose(a, b, atol=ATOL, rtol=RTOL))
        errs[name] = _f((a - b).abs().max()) if a.numel() else 0.0
    nbt_f, nbt_r = f.num_batches_tracked, r.num_batches_tracked
    if nbt_f is not None and nbt_r is not None:
        ok = ok and int(nbt_f.item()) == int(nbt_r.item())
    return {"running_stats_ok": ok, "running_mean_max_abs_err": errs["running_mean"],
            "running_var_max_abs_err": errs["running_var"]}


def check_correctness(model: torch.nn.Module, fused: torch.nn.Module, batch: int,
                      in_features: int, device: torch.device, seeds: Sequence[int],
                      step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Compare ``fused`` with a float64 copy of ``model`` over seeds x distributions.

    The float64 reference copy is made here and freed before returning. Returns the
    per-trial records and the worst errors; ``correct`` is True when every trial passed.
    The original model's own float32 error (``eager_*``) is recorded as a baseline; it
    does not decide ``correct``. (Model 39 in training mode: that run also updates the
    original's running statistics, which nothing here compares.)
    """
    ref = copy.deepcopy(model).double()
    ref.train(model.training)
    has_bn = _bn_of(fused) is not None
    trials = []
    try:
        with torch.no_grad():
            for seed in seeds:
                for dname, draw in DISTRIBUTIONS.items():
                    if step is not None:
                        step(f"check seed {seed}, x ~ {dname}")
                    gen = torch.Generator(device=device)
                    gen.manual_seed(int(seed))
                    x = draw((batch, in_features), gen, device)
                    if has_bn:
                        _copy_bn_buffers(fused, ref)  # both start from the same statistics
                    out = fused(x)
                    ref_out = ref(x.double())
                    rec: dict[str, Any] = {"seed": int(seed), "dist": dname}
                    rec.update(compare(out, ref_out))
                    if has_bn:
                        rec.update(_compare_bn_buffers(fused, ref))
                        rec["allclose"] = rec["allclose"] and rec.get("running_stats_ok", True)
                    del out
                    # Baseline: the original model's own fp32 error (PyTorch eager, TF32 off).
                    with fp32_strict():
                        base = compare(model(x), ref_out)
                    rec["eager_allclose"] = base["allclose"]
                    rec["eager_max_abs_err"] = base["max_abs_err"]
                    rec["eager_rel_err"] = base["rel_err"]
                    trials.append(rec)
                    del x, ref_out, base
    finally:
        del ref
    res: dict[str, Any] = {
        "correct": bool(trials) and all(t["allclose"] for t in trials),
        "max_abs_err": _worst([t["max_abs_err"] for t in trials]),
        "rel_err": _worst([t["rel_err"] for t in trials]),
        "max_elem_rel_err": _worst([t["max_elem_rel_err"] for t in trials]),
        "eager_max_abs_err": _worst([t["eager_max_abs_err"] for t in trials]),
        "eager_rel_err": _worst([t["eager_rel_err"] for t in trials]),
        "trials": trials,
    }
    if has_bn:
        res["running_stats_ok"] = all(t.get("running_stats_ok", True) for t in trials)
    return res


# ---------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------
@contextmanager
def fp32_strict() -> Iterator[None]:
    """TF32 off for cuBLAS matmuls and cuDNN (PyTorch's fp32 default), restored after."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # newer torch warns about the legacy flags
        old_mm = torch.backends.cuda.matmul.allow_tf32
        old_cudnn = torch.backends.cudnn.allow_tf32
        old_prec = torch.get_float32_matmul_precision()
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.set_float32_matmul_precision(old_prec)
            torch.backends.cuda.matmul.allow_tf32 = old_mm
            torch.backends.cudnn.allow_tf32 = old_cudnn


_FLUSH_BYTES = 256 * 1024 * 1024  # larger than any current GPU's L2, as do_bench uses


def _estimate_ms(fn: Callable[[], Any], flush: torch.Tensor, n: int = 5) -> float:
    """Mean ms of ``fn`` with an L2 flush before each call (what do_bench will see)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    return max(start.elapsed_time(end) / n, 1e-3)


def _event_loop_ms(fn: Callable[[], Any], reps: int, flush: torch.Tensor,
                   warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()  # every run starts from a cold L2, like do_bench
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])


def time_ms(fn: Callable[[], Any], reps: int = DEFAULT_REPS) -> tuple[float, str]:
    """Median ms of ``fn`` over about ``reps`` timed runs (warmed up), and the timer used.

    ``triton.testing.do_bench(..., return_mode="median")`` when Triton imports (its
    warm-up and repeat arguments are in ms: they are derived here from a first
    estimate so that about ``reps`` runs are timed), else a CUDA-event loop.
    """
    reps = max(1, int(reps))
    device = torch.cuda.current_device()
    flush = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    try:
        fn()  # first call: plan building, lazy compilation, cuBLAS handles
        torch.cuda.synchronize()
        do_bench = _triton_do_bench()
        if do_bench is not None:
            est = _estimate_ms(fn, flush)
            warmup_ms = max(25.0, 10 * est)
            rep_ms = max(1.0, reps * est)
            try:
                return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")), \
                    "triton.testing.do_bench (median)"
            except TypeError:  # an old Triton without return_mode
                q = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5])
                return float(q[0] if isinstance(q, (list, tuple)) else q), \
                    "triton.testing.do_bench (median)"
        return _event_loop_ms(fn, reps, flush), "CUDA events (median)"
    finally:
        del flush


# ---------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------
@dataclass
class BenchOptions:
    problems: list[str] = field(default_factory=lambda: list(ALL_PROBLEMS))
    sizes: list[str] | None = None          # None: the default for the device
    seeds: list[int] = field(default_factory=lambda: list(DEFAULT_SEEDS))
    reps: int = DEFAULT_REPS
    compile: bool = True
    json_path: str | None = None
    plot_path: str | None = None


def _free_device_memory(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        try:
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()
        except Exception:
            pass


def _new_record(problem: str, size: str) -> dict[str, Any]:
    from cupyfuse.kernelbench.models import PROBLEMS

    prob = PROBLEMS[problem]
    batch, init = prob.sizes[size]
    return {
        "problem": problem, "name": prob.name, "size": size, "batch": batch,
        "init_args": [list(a) if isinstance(a, tuple) else a for a in init],
        "correct": False, "max_abs_err": None, "rel_err": None, "max_elem_rel_err": None,
        "eager_max_abs_err": None, "eager_rel_err": None,
        "eager_ms": None, "compile_ms": None, "cupyfuse_ms": None, "compile_error": None,
        "speedup_vs_eager": None, "speedup_vs_compile": None,
        "floor_ms": FLOORS_MS.get((problem, size)), "pct_of_floor": None,
        "timer": None, "peak_mem_gib": None, "seconds": None, "error": None, "trials": [],
    }


def _build(problem: str, size: str, device: torch.device) -> torch.nn.Module:
    from cupyfuse.kernelbench.models import make_model

    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(MODEL_SEED)
        return make_model(problem, size, device)


def run_case(problem: str, size: str, device: torch.device, opts: BenchOptions,
             timing: bool, progress: Progress) -> dict[str, Any]:
    """Build, check and (when ``timing``) time one (problem, size); never raises."""

    from cupyfuse import from_model

    rec = _new_record(problem, size)
    tag = f"{problem}/{size}"
    cuda = device.type == "cuda"
    t0 = time.monotonic()
    model = fused = compiled = None
    used_compile = False
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        progress.step(f"{tag}: building models")
        model = _build(problem, size, device)
        fused = from_model(copy.deepcopy(model))
        batch = rec["batch"]
        in_features = rec["init_args"][0]
        rec.update(check_correctness(model, fused, batch, in_features, device, opts.seeds,
                                     step=lambda s: progress.step(f"{tag}: {s}")))
        _free_device_memory(cuda)  # the float64 copy is gone: give its memory back
        if timing:
            gen = torch.Generator(device=device)
            gen.manual_seed(12345)
            x = torch.rand(batch, in_features, generator=gen, device=device)
            with torch.no_grad(), fp32_strict():
                progress.step(f"{tag}: timing PyTorch eager")
                rec["eager_ms"], rec["timer"] = time_ms(lambda: model(x), opts.reps)
                if opts.compile:
                    progress.step(f"{tag}: torch.compile (compiling + timing)")
                    try:
                        used_compile = True
                        compiled = torch.compile(model)
                        with warnings.catch_warnings():
                            # Inductor's hint to enable TF32: off on purpose here.
                            warnings.filterwarnings("ignore", message=".*TensorFloat32 tensor cores")
                            rec["compile_ms"], _ = time_ms(lambda: compiled(x), opts.reps)
                    except Exception as exc:  # report "n/a", keep going
                        rec["compile_error"] = f"{exc.__class__.__name__}: {_first_line(exc)}"
                        progress.message(f"{tag}: torch.compile failed, reported n/a "
                                         f"({rec['compile_error']})")
                progress.step(f"{tag}: timing cupyfuse")
                rec["cupyfuse_ms"], _ = time_ms(lambda: fused(x), opts.reps)
            del x
            _fill_ratios(rec)
    except Exception as exc:
        rec["correct"] = False
        rec["error"] = f"{exc.__class__.__name__}: {_first_line(exc)}"
        progress.message(f"{tag}: ERROR {rec['error']}")
        tb = traceback.format_exc()
        progress.message("\n".join("    " + ln for ln in tb.rstrip().splitlines()[-12:]))
    finally:
        if cuda:
            try:
                rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            except Exception:
                pass
        del model, fused, compiled
        if used_compile:
            try:
                torch._dynamo.reset()  # compiled graphs hold the model's weights
            except Exception:
                pass
        _free_device_memory(cuda)
        rec["seconds"] = time.monotonic() - t0
    return rec


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def _fill_ratios(rec: dict[str, Any]) -> None:
    fz = rec["cupyfuse_ms"]
    if not fz:
        return
    if rec["eager_ms"]:
        rec["speedup_vs_eager"] = rec["eager_ms"] / fz
    if rec["compile_ms"]:
        rec["speedup_vs_compile"] = rec["compile_ms"] / fz
    if rec["floor_ms"]:
        rec["pct_of_floor"] = 100.0 * rec["floor_ms"] / fz


# ---------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------
def _fmt_err(v: float | None) -> str:
    if v is None:
        return "?"
    if math.isnan(v):
        return "nan"
    return f"{v:.1e}"


def _fmt_ms(v: float | None, timed: bool) -> str:
    if not timed:
        return "-"
    if v is None:
        return "n/a"
    return f"{v:.3f}" if v < 10 else f"{v:.2f}"


def _fmt_ratio(v: float | None, timed: bool) -> str:
    if not timed:
        return "-"
    return "n/a" if v is None else f"{v:.2f}x"


def format_table(results: Sequence[dict[str, Any]], timed: bool) -> str:
    headers = ["problem", "size", "correct (rel err)", "eager ms", "compile ms", "cupyfuse ms",
               "vs eager", "vs compile", "% of floor"]
    rows = []
    for r in results:
        if r.get("error") and not r.get("trials"):
            correct = "ERROR"
        else:
            correct = f"{'pass' if r['correct'] else 'FAIL'} {_fmt_err(r['rel_err'])}"
        floor = "-"
        if timed and r.get("floor_ms"):
            floor = "n/a" if r["pct_of_floor"] is None else f"{r['pct_of_floor']:.0f}%"
        rows.append([
            f"{r['problem']} {r['name']}", r["size"], correct,
            _fmt_ms(r["eager_ms"], timed), _fmt_ms(r["compile_ms"], timed),
            _fmt_ms(r["cupyfuse_ms"], timed),
            _fmt_ratio(r["speedup_vs_eager"], timed), _fmt_ratio(r["speedup_vs_compile"], timed),
            floor,
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    left = {0, 1, 2}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    return "\n".join(out)


def _json_safe(obj: Any) -> Any:
    """Plain JSON: non-finite floats become the strings "NaN", "Infinity", "-Infinity"."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "NaN"
        if math.isinf(obj):
            return "Infinity" if obj > 0 else "-Infinity"
        return obj
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)


def write_plot(results: Sequence[dict[str, Any]], path: str, title: str = "") -> bool:
    """Bar chart of eager / compile / cupyfuse ms per case (log scale); False if not written."""
    timed = [r for r in results if any(r.get(k) for k in ("eager_ms", "compile_ms", "cupyfuse_ms"))]
    if not timed:
        print(f"--plot: no timings to plot (they need a GPU); {path} not written", file=sys.stderr)
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install matplotlib, or "
              f"pip install 'cupyfuse[bench]'); {path} not written, the rest of the "
              "benchmark is unaffected", file=sys.stderr)
        return False
    series = [("eager_ms", "PyTorch eager fp32", "#8c8c8c"),
              ("compile_ms", "torch.compile", "#4c72b0"),
              ("cupyfuse_ms", "cupyfuse", "#dd8452")]
    n = len(timed)
    width = 0.26
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * n + 2), 4.8))
    for j, (key, label, color) in enumerate(series):
        xs = [i + (j - 1) * width for i in range(n)]
        vals = [r.get(key) or 0.0 for r in timed]
        bars = ax.bar(xs, vals, width, label=label, color=color)
        for b, v in zip(bars, vals):
            x_mid = b.get_x() + b.get_width() / 2
            if v:
                ax.annotate(f"{v:.3g}", (x_mid, v), ha="center", va="bottom", fontsize=7,
                            xytext=(0, 2), textcoords="offset points")
            else:  # not measured (torch.compile failed or skipped)
                ax.annotate("n/a", (x_mid, 0), xycoords=("data", "axes fraction"),
                            ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                            textcoords="offset points")
    floor_drawn = False
    for i, r in enumerate(timed):
        if r.get("floor_ms"):
            ax.hlines(r["floor_ms"], i - 1.5 * width, i + 1.5 * width, colors="black",
                      linestyles="dashed", linewidth=1,
                      label=None if floor_drawn else f"fp32 floor ({FLOOR_DEVICE})")
            floor_drawn = True
    ax.set_xticks(range(n))
    ax.set_xticklabels([f"{r['problem']} {r['size']}\n{'pass' if r['correct'] else 'FAIL'}"
                        for r in timed])
    ax.set_yscale("log")
    ax.set_ylabel("median time (ms, log scale)")
    ax.set_title(title or "cupyfuse benchmark")
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------
def run_bench(opts: BenchOptions, stdout: TextIO | None = None,
              stderr: TextIO | None = None) -> int:
    """Run the benchmark; print the header and table to ``stdout``. Exit code: 0 when
    every correctness check passed, 1 otherwise."""
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr

    pending: list[str] = []  # notes found before the header is printed

    def note(msg: str) -> None:
        err.write(msg + "\n")
        err.flush()

    gpu, why = gpu_available()
    explicit_sizes = opts.sizes is not None
    if gpu:
        device = torch.device("cuda", torch.cuda.current_device())
        sizes = list(opts.sizes) if explicit_sizes else list(DEFAULT_GPU_SIZES)
    else:
        device = torch.device("cpu")
        if explicit_sizes and any(s != "small" for s in opts.sizes):
            skipped = [s for s in opts.sizes if s != "small"]
            pending.append(f"no GPU: size(s) {', '.join(skipped)} skipped; the CPU path is "
                           f"checked at size 'small' only")
        sizes = ["small"]
    cases = select_cases(opts.problems, sizes, explicit_sizes, pending.append)

    ver = _versions()
    meta: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "gpu": gpu,
        "no_gpu_reason": None if gpu else why,
        "torch": ver["torch"], "cupy": ver["cupy"], "cupyfuse": ver["cupyfuse"],
        "triton": ver["triton"], "python": ver["python"], "gemm_engine": ver["gemm_engine"],
        "info": ver["info"],
        "problems": list(opts.problems), "sizes": sizes, "seeds": list(opts.seeds),
        "distributions": list(DISTRIBUTIONS), "atol": ATOL, "rtol": RTOL,
        "reps": opts.reps if gpu else None,
        "compile": bool(opts.compile) if gpu else None,
        "tf32": False,
        "floors_ms": {f"{p}/{s}": v for (p, s), v in FLOORS_MS.items()},
        "floor_device": FLOOR_DEVICE,
    }

    out.write(f"cupyfuse {meta['cupyfuse']} bench  {meta['date']}\n")
    out.write(f"device: {meta['device']}  |  torch {meta['torch']}  |  cupy {meta['cupy']}"
              f"  |  triton {meta['triton'] or '-'}\n")
    out.write(f"gemm engine: {meta['gemm_engine']}\n")
    if gpu:
        timer = "triton.testing.do_bench" if _triton_do_bench() else "CUDA events"
        out.write(f"timing: median of ~{opts.reps} runs ({timer}), torch.no_grad(), eager and "
                  f"compile in fp32 with TF32 off{'' if opts.compile else ', torch.compile skipped'}\n")
    else:
        out.write(f"No GPU found ({why}): timings are skipped; checking the correctness of "
                  f"the CPU path at size 'small' only.\n")
    out.flush()
    for msg in pending:
        note(msg)

    if not cases:
        note("nothing to run: no selected problem has a selected size")
        _write_json(opts.json_path, meta, [], note)
        return 1

    ntr = len(opts.seeds) * len(DISTRIBUTIONS)
    per_case = 1 + ntr + ((2 + int(opts.compile)) if gpu else 0)
    progress = Progress(len(cases) * per_case, stream=err)
    results = []
    try:
        for problem, size in cases:
            results.append(run_case(problem, size, device, opts, gpu, progress))
    finally:
        progress.close()

    all_ok = all(r["correct"] for r in results)
    out.write("\n" + format_table(results, gpu) + "\n")
    out.write(f"\ncorrect: torch.allclose(out, float64 reference, atol={ATOL:g}, rtol={RTOL:g}) "
              f"on seeds {','.join(map(str, opts.seeds))} x inputs "
              f"{' and '.join(DISTRIBUTIONS)}; rel err = max ||out-ref||/||ref|| (the JSON also "
              f"has max abs, elementwise and PyTorch eager fp32's own errors).\n")
    if gpu:
        out.write("speedups = time / cupyfuse time; % of floor = fp32-accurate floor / cupyfuse "
                  f"time (floors from PERF.md, {FLOOR_DEVICE})")
        if "H100" not in meta["device"]:
            out.write(f"; this device is not an H100, so % of floor is indicative only")
        out.write(".\n")
    for r in results:
        if r.get("error"):
            out.write(f"{r['problem']}/{r['size']}: error: {r['error']}\n")
        elif not r["correct"]:
            bad = [t for t in r["trials"] if not t["allclose"]]
            t = bad[0] if bad else {}
            extra = ""
            if t.get("running_stats_ok") is False:
                extra = ", running statistics differ"
            if t.get("error"):
                extra += f", {t['error']}"
            out.write(f"{r['problem']}/{r['size']}: FAILED on {len(bad)}/{len(r['trials'])} "
                      f"trials (first: seed {t.get('seed')}, x ~ {t.get('dist')}: max abs err "
                      f"{_fmt_err(t.get('max_abs_err'))}, rel err {_fmt_err(t.get('rel_err'))}"
                      f"{extra})\n")
        if r.get("compile_error"):
            out.write(f"{r['problem']}/{r['size']}: torch.compile n/a: {r['compile_error']}\n")
    out.write(f"{'all correct' if all_ok else 'SOME CHECKS FAILED'}\n")
    out.flush()

    meta["all_correct"] = all_ok
    _write_json(opts.json_path, meta, results, note)
    if opts.plot_path:
        if write_plot(results, opts.plot_path, title=f"cupyfuse on {meta['device']}"):
            note(f"plot written to {opts.plot_path}")
    return 0 if all_ok else 1


def _write_json(path: str | None, meta: dict[str, Any], results: list[dict[str, Any]],
                note: Callable[[str], None]) -> None:
    if not path:
        return
    doc = {"meta": meta, "all_correct": bool(results) and all(r["correct"] for r in results),
           "results": results}
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(_json_safe(doc), fh, indent=2)
        fh.write("\n")
    note(f"results written to {path}")
