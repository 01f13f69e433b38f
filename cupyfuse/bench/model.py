"""``python -m cupyfuse bench --model FILE [FILE ...]``: check and time any model file
in KernelBench's format (a ``Model`` class, ``get_inputs()``, ``get_init_inputs()``).

For each file: ``ModelNew = cupyfuse.fused_class(Model)`` is built with the same seed
as the original (so the same parameters), in train mode as KernelBench runs it.

* correctness: for each seed, fresh inputs from ``get_inputs()``; the fused output
  against the fp32 original (KernelBench's rule, ``allclose(atol=rtol=1e-4)``) and
  against a float64 copy of the original (ours); outputs pre-filled with nothing: the
  fused model allocates its own, so an unwritten element would show as garbage/NaN.
* timing (GPU only): KernelBench's conditions -- grad mode, parameters requiring grad,
  the L2 cache flushed before each call, CUDA events, median of ``reps`` -- for eager
  and fused, and the same under ``torch.no_grad()``.

* host cost (GPU only): the time a call takes on the host where the GPU work is a few
  microseconds -- the file loaded again with its sizes shrunk (batch 32, 512 features:
  ``HOST_SIZES``), a loop of 300 calls synchronised outside it, median of 5 loops -- for
  eager and fused, grad mode and ``no_grad`` (:func:`host_cost`).

* training step (``--train``): a step as a training loop runs it -- gradients set to
  None, forward, ``backward`` of every floating output with a fixed random cotangent --
  with the parameters and the floating inputs requiring grad, for eager and fused:
  median ms (L2 flushed, CUDA events), peak memory of a step (``max_memory_allocated``
  from the state before it), and every gradient against a float64 copy's (within 1e-4 of
  the gradient's largest finite magnitude, at least 1). On the CPU only the gradient
  check runs.

Without a GPU it runs the correctness part on the CPU at the file's own sizes, where they
fit: the memory a file needs (its parameters, inputs and outputs, measured on the meta
device, times the copies the check holds: fp32 original and fused, float64 reference)
is compared with the machine's available memory first, and a file that does not fit is
skipped with both figures (``--cpu-max-gb`` sets the budget).
"""
from __future__ import annotations

import copy
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

__all__ = ["load_model_file", "run_model_bench", "host_cost", "shrink_sizes"]

ATOL = RTOL = 1e-4


def load_model_file(path: str) -> Any:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"bench --model: no such file {path}")
    spec = importlib.util.spec_from_file_location(f"cupyfuse_user_{p.stem}", p)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = mod  # type: ignore[union-attr]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    for name in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(mod, name):
            raise ValueError(f"bench --model: {path} has no `{name}` (KernelBench's format: a "
                             "Model class, get_inputs() and get_init_inputs())")
    return mod


def _to(objs: Sequence[Any], device: Any, dtype: Any = None) -> list:
    out = []
    for o in objs:
        if isinstance(o, torch.Tensor):
            o = o.to(device)
            if dtype is not None and o.is_floating_point():
                o = o.to(dtype)
        out.append(o)
    return out


# fp32 original + fused + float64 original and fused copy (two fp32 each), with room for
# the forward's intermediates (a few output-sized tensors per model)
_CPU_COPIES = 8


def available_gb() -> float:
    """The machine's available memory in GB (MemAvailable; inf where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return math.inf


def footprint_gb(mod: Any) -> float:
    """The memory the CPU check of a model file needs, in GB: the float32 bytes of its
    parameters, one set of inputs and its output, measured on the meta device (nothing
    allocated), times the copies the check holds."""
    with torch.device("meta"):
        init = mod.get_init_inputs()
        model = mod.Model(*init)
        inputs = mod.get_inputs()
        with torch.no_grad():
            out = model(*inputs)
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [t for t in inputs if isinstance(t, torch.Tensor)]
    tensors += [t for t in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(t, torch.Tensor)]
    return _CPU_COPIES * 4 * sum(t.numel() for t in tensors) / 2**30


#: the module-level sizes a file is shrunk to for its host cost (names KernelBench uses)
HOST_SIZES = {"batch_size": 32, "in_features": 512, "input_size": 512, "out_features": 512,
              "hidden_size": 512, "output_size": 512}


def _loop_us(fn: Callable[[], Any], device: torch.device, calls: int = 300,
             loops: int = 5) -> float:
    """Microseconds per call of ``fn``: ``calls`` calls in a loop synchronised outside it
    (the launches queue behind each other), median of ``loops`` loops."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(loops):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times) * 1e6


def shrink_sizes(mod: Any, sizes: dict[str, int]) -> Any:
    """A loaded model file with its module-level sizes set to ``sizes`` (the names it
    has), and the shapes it built from them at load time (``bias_shape =
    (out_features,)``) rebuilt with the new values; the module itself, changed."""
    old = {}
    for name, v in sizes.items():
        if isinstance(getattr(mod, name, None), int):
            old[getattr(mod, name)] = v
            setattr(mod, name, v)
    for name, v in list(vars(mod).items()):
        if isinstance(v, tuple) and v and all(type(e) is int for e in v):
            setattr(mod, name, tuple(old.get(e, e) for e in v))
    return mod


def host_cost(path: str, device: torch.device) -> dict[str, float]:
    """Host cost per call (us) of a model file's original and ``fused_class`` copy, grad
    mode and ``no_grad``, at ``HOST_SIZES`` (the file's other constants kept)."""
    import cupyfuse

    mod = shrink_sizes(load_model_file(path), HOST_SIZES)
    init = mod.get_init_inputs()
    torch.manual_seed(0)
    orig = mod.Model(*init).to(device)
    fused = cupyfuse.fused_class(mod.Model)(*init).to(device)
    fused.load_state_dict(orig.state_dict())
    torch.manual_seed(4000)
    inputs = _to(mod.get_inputs(), device)
    rec = {"eager_host_us": _loop_us(lambda: orig(*inputs), device),
           "fused_host_us": _loop_us(lambda: fused(*inputs), device)}
    with torch.no_grad():
        rec["eager_nograd_host_us"] = _loop_us(lambda: orig(*inputs), device)
        rec["fused_nograd_host_us"] = _loop_us(lambda: fused(*inputs), device)
    return rec


def _flush_buffer(device: torch.device) -> torch.Tensor | None:
    if device.type != "cuda":
        return None
    return torch.empty(int(256e6 // 4), dtype=torch.float32, device=device)


def time_kb(fn: Callable[[], Any], reps: int, device: torch.device, warmup: int = 3) -> float:
    """Median ms per call: L2 flushed before each call, CUDA events around the call."""
    flush = _flush_buffer(device)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    times = []
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return statistics.median(times)


def _compare(out: Any, ref: Any) -> dict[str, Any]:
    """``out`` against ``ref`` (a tensor, or a tuple/list of them: each in turn; integer
    results must be equal): ok, largest absolute error, largest relative error."""
    if isinstance(ref, (tuple, list)):
        if not isinstance(out, (tuple, list)) or len(out) != len(ref):
            return {"ok": False, "why": "not the same number of results"}
        parts = [_compare(o, r) for o, r in zip(out, ref)]
        return {"ok": all(p["ok"] for p in parts),
                "max_abs": max((p.get("max_abs", math.inf) for p in parts), default=0.0),
                "rel": max((p.get("rel", math.inf) for p in parts), default=0.0)}
    if not ref.is_floating_point():
        ok = isinstance(out, torch.Tensor) and out.dtype == ref.dtype and \
            torch.equal(out.cpu(), ref.cpu())
        return {"ok": ok, "max_abs": 0.0 if ok else math.inf, "rel": 0.0 if ok else math.inf}
    o = out.detach().double().cpu()
    r = ref.detach().double().cpu()
    if o.shape != r.shape:
        return {"ok": False, "why": f"shape {tuple(o.shape)} vs {tuple(r.shape)}"}
    same_nan = bool(torch.equal(torch.isnan(o), torch.isnan(r)))
    ok = bool(torch.allclose(o, r, atol=ATOL, rtol=RTOL, equal_nan=True)) and same_nan
    fin = torch.isfinite(o) & torch.isfinite(r)
    err = float((o[fin] - r[fin]).abs().max()) if fin.any() else 0.0
    rel = float((o[fin] - r[fin]).norm() / max(float(r[fin].norm()), 1e-30)) if fin.any() else 0.0
    return {"ok": ok, "max_abs": err, "rel": rel}


def bench_file(path: str, device: torch.device, seeds: Sequence[int], reps: int,
               log: Callable[[str], None], cpu_max_gb: float | None = None,
               train: bool = False) -> dict[str, Any]:
    import cupyfuse

    mod = load_model_file(path)
    rec: dict[str, Any] = {"file": path, "name": Path(path).stem}
    if device.type == "cpu":
        need = footprint_gb(mod) * (2 if train else 1)   # (the gradients, fp32 and float64)
        budget = available_gb() * 0.8 if cpu_max_gb is None else cpu_max_gb
        if need > budget:
            have = ("available" if cpu_max_gb is None else "allowed") + " (--cpu-max-gb)"
            rec["skipped"] = (f"needs ~{need:.2g} GB at its own sizes on the CPU, "
                              f"{budget:.2g} GB {have}; run it on a GPU")
            log(f"  skipped: {rec['skipped']}")
            return rec
    init = mod.get_init_inputs()
    torch.manual_seed(0)
    orig = mod.Model(*init).to(device)
    New = cupyfuse.fused_class(mod.Model)
    torch.manual_seed(0)
    fused = New(*init).to(device)
    rec["params_equal"] = all(torch.equal(a, b) for a, b in
                              zip(orig.state_dict().values(), fused.state_dict().values()))
    checks = []
    t0 = time.perf_counter()
    for s in seeds:
        torch.manual_seed(1000 + s)
        inputs = _to(mod.get_inputs(), device)
        try:
            out = fused(*inputs)
        except ValueError as exc:  # TailError included: refused
            rec["refused"] = str(exc).splitlines()[0]
            log(f"  refused: {rec['refused']}")
            return rec
        ref = orig(*inputs)
        kb = _compare(out, ref)
        # float64 reference: a double copy of the original *before* this call's BN update
        checks.append({"seed": s, "kb": kb})
        del out, ref
    rec["first_call_s"] = time.perf_counter() - t0
    rec["kb_ok"] = all(c["kb"]["ok"] for c in checks)
    rec["kb_max_abs"] = max(c["kb"].get("max_abs", math.inf) for c in checks)
    rec["kb_rel"] = max(c["kb"].get("rel", math.inf) for c in checks)
    # float64 check on one seed, at the file's size (a double copy of both, fresh state)
    try:
        torch.manual_seed(0)
        o64 = mod.Model(*init).to(device).double()
        torch.manual_seed(0)
        f32 = New(*init).to(device)
        torch.manual_seed(2000)
        inputs = _to(mod.get_inputs(), device)
        torch.manual_seed(0)
        e32 = mod.Model(*init).to(device)
        r64 = o64(*_to(inputs, device, torch.float64))
        c64 = _compare(f32(*inputs), r64)
        rec["f64_ok"], rec["f64_rel"] = c64["ok"], c64.get("rel")
        # does PyTorch eager fp32 itself pass against float64? (KernelBench compares the
        # fused output with eager fp32, so where eager fails this, its check is noise)
        e64 = _compare(e32(*inputs), r64)
        rec["eager_f64_ok"], rec["eager_f64_rel"] = e64["ok"], e64.get("rel")
        del o64, f32, r64, e32
    except torch.cuda.OutOfMemoryError:
        rec["f64_ok"] = None
    if device.type == "cuda":
        torch.manual_seed(3000)
        inputs = _to(mod.get_inputs(), device)
        rec["eager_ms"] = time_kb(lambda: orig(*inputs), reps, device)
        rec["fused_ms"] = time_kb(lambda: fused(*inputs), reps, device)
        with torch.no_grad():
            rec["eager_nograd_ms"] = time_kb(lambda: orig(*inputs), reps, device)
            rec["fused_nograd_ms"] = time_kb(lambda: fused(*inputs), reps, device)
        rec["speedup"] = rec["eager_ms"] / rec["fused_ms"]
        rec["speedup_nograd"] = rec["eager_nograd_ms"] / rec["fused_nograd_ms"]
        rec.update(host_cost(path, device))
    if train:
        rec.update(train_file(mod, New, device, reps))
    return rec


def _step(model: Any, inputs: Sequence[Any], cots: Sequence[torch.Tensor | None]) -> list:
    """One training step's work: gradients set to None, forward, backward of the floating
    outputs with ``cots``; returns the outputs."""
    for p in model.parameters():
        p.grad = None
    for t in inputs:
        if isinstance(t, torch.Tensor):
            t.grad = None
    out = model(*inputs)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    pairs = [(o, g) for o, g in zip(outs, cots) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return outs


def _grads(model: Any, inputs: Sequence[Any]) -> list:
    return [t.grad for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad] + \
        [p.grad for p in model.parameters() if p.requires_grad]


def _train_inputs(mod: Any, device: torch.device, dtype: Any = None) -> list:
    ins = _to(mod.get_inputs(), device, dtype)
    return [t.requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point()
            else t for t in ins]


def train_file(mod: Any, New: Any, device: torch.device, reps: int) -> dict[str, Any]:
    """The ``--train`` figures of one model file (see the module docstring)."""
    init = mod.get_init_inputs()
    rec: dict[str, Any] = {}
    torch.manual_seed(0)
    orig = mod.Model(*init).to(device)
    torch.manual_seed(0)
    fused = New(*init).to(device)
    torch.manual_seed(0)
    o64 = mod.Model(*init).to(device).double()
    torch.manual_seed(4000)
    inputs = _train_inputs(mod, device)
    with torch.no_grad():
        out = orig(*inputs)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    cots = [torch.randn_like(o) if o.is_floating_point() else None for o in outs]
    del out, outs
    # gradients against float64 (one step from the same state)
    in64 = [t.detach().double().requires_grad_(True) if isinstance(t, torch.Tensor) and
            t.is_floating_point() else t for t in inputs]
    _step(o64, in64, [None if g is None else g.double() for g in cots])
    _step(fused, inputs, cots)
    # (a gradient is a sum over the batch and features of cotangents of magnitude ~1: its
    # error is relative to its largest finite magnitude, at least 1; a missing one is 0)
    bad = []
    for i, (a, b) in enumerate(zip(_grads(fused, inputs), _grads(o64, in64))):
        if a is None and b is None:
            continue
        ref = b if b is not None else torch.zeros(a.shape, dtype=torch.float64, device=a.device)
        got = a.double() if a is not None else torch.zeros_like(ref)
        fin = ref[torch.isfinite(ref)]
        scale = max(1.0, float(fin.abs().max())) if fin.numel() else 1.0
        if not torch.allclose(got, ref, atol=1e-4 * scale, rtol=1e-4, equal_nan=True):
            bad.append(i)
    rec["grad_ok"] = not bad
    if bad:
        rec["grad_bad"] = bad
    from cupyfuse import autograd
    from cupyfuse.api import program

    try:   # (which backward the step took: the backward program or the recompute)
        rec["backward"] = autograd.backward_kind(
            program(fused, *[t.detach() if isinstance(t, torch.Tensor) else t
                             for t in inputs]), device)
    except ValueError as e:   # (a TailError: the model's program is not one cupyfuse has)
        rec["backward"] = f"unknown ({e})"[:120]
    del o64, in64
    if device.type != "cuda":
        return rec
    for name, m in (("eager", orig), ("fused", fused)):
        rec[f"train_{name}_ms"] = time_kb(lambda: _step(m, inputs, cots), reps, device)
        for p in m.parameters():
            p.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _step(m, inputs, cots)
        torch.cuda.synchronize(device)
        rec[f"train_{name}_peak_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    rec["train_speedup"] = rec["train_eager_ms"] / rec["train_fused_ms"]
    return rec


def format_train_rows(recs: Sequence[dict[str, Any]]) -> str:
    lines = ["| model | gradients vs float64 | backward | eager step ms | fused step ms | "
             "speedup | step peak MiB eager / fused |", "|" + "---|" * 7]
    for r in recs:
        if "grad_ok" not in r:
            continue
        t = r.get("train_speedup")
        lines.append(
            f"| {r['name']} | {'pass' if r['grad_ok'] else 'FAIL'} | "
            f"{r.get('backward', '—')} | "
            + (f"{r['train_eager_ms']:.3f} | {r['train_fused_ms']:.3f} | {t:.2f}x | "
               f"{r['train_eager_peak_mb']:.0f} / {r['train_fused_peak_mb']:.0f} |"
               if t is not None else "— | — | — | — |"))
    sp = [r["train_speedup"] for r in recs if r.get("train_speedup")]
    if sp:
        gm = math.exp(sum(math.log(x) for x in sp) / len(sp))
        lines.append(f"\ngeometric mean training-step speedup: {gm:.2f}x over {len(sp)} "
                     f"models; min {min(sp):.2f}x")
    return "\n".join(lines)


def format_rows(recs: Sequence[dict[str, Any]]) -> str:
    head = ("| model | KB check | max abs err | rel err | f64 check | eager's f64 check | "
            "eager ms | fused ms | speedup | no_grad eager | no_grad fused | speedup | "
            "host us eager / fused (no_grad) |")
    lines = [head, "|" + "---|" * 13]

    def f(v: Any, fmt: str = "{:.3f}") -> str:
        return "—" if v is None else fmt.format(v)

    for r in recs:
        if "refused" in r or "error" in r or "skipped" in r:
            why = r.get("refused") or r.get("error") or r.get("skipped")
            what = "skipped" if "skipped" in r else "refused" if "refused" in r else "error"
            lines.append(f"| {r['name']} | {what}: {why[:100]} |" + " |" * 11)
            continue
        host = (f"{r['eager_host_us']:.1f} / {r['fused_host_us']:.1f} "
                f"({r['eager_nograd_host_us']:.1f} / {r['fused_nograd_host_us']:.1f})"
                if "fused_host_us" in r else "—")
        lines.append(
            f"| {r['name']} | {'pass' if r['kb_ok'] else 'FAIL'} | {f(r['kb_max_abs'], '{:.1e}')} | "
            f"{f(r['kb_rel'], '{:.1e}')} | {f(r.get('f64_ok'), '{}')} | "
            f"{f(r.get('eager_f64_ok'), '{}')} | {f(r.get('eager_ms'))} | "
            f"{f(r.get('fused_ms'))} | {f(r.get('speedup'), '{:.2f}x')} | "
            f"{f(r.get('eager_nograd_ms'))} | {f(r.get('fused_nograd_ms'))} | "
            f"{f(r.get('speedup_nograd'), '{:.2f}x')} | {host} |")
    sp = [r["speedup"] for r in recs if r.get("speedup")]
    hosts = [max(r["fused_host_us"], r["fused_nograd_host_us"]) for r in recs
             if "fused_host_us" in r]
    if hosts:
        lines.append(f"\nhost cost per call, fused (grad mode or no_grad, the larger): "
                     f"max {max(hosts):.1f} us, median {statistics.median(hosts):.1f} us")
    if sp:
        gm = math.exp(sum(math.log(x) for x in sp) / len(sp))
        lines.append(f"\ngeometric mean speedup (grad mode, KB timing): {gm:.2f}x over {len(sp)} "
                     f"models; min {min(sp):.2f}x")
    return "\n".join(lines)


def run_model_bench(paths: Sequence[str], seeds: Sequence[int] = (0, 1, 2), reps: int = 20,
                    json_path: str | None = None, stdout: Any = None,
                    cpu_max_gb: float | None = None, train: bool = False) -> int:
    out = stdout or sys.stdout
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")

    def log(msg: str) -> None:
        print(msg, file=out, flush=True)

    if not cuda:
        log("bench --model: no CUDA device: checking correctness on the CPU only (no timings)")
    recs = []
    for i, p in enumerate(paths):
        log(f"[{i + 1}/{len(paths)}] {p}")
        try:
            rec = bench_file(p, device, seeds, reps, log, cpu_max_gb, train)
        except Exception as exc:  # report and go on with the next file
            rec = {"file": p, "name": Path(p).stem, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            log(f"  error: {rec['error']}")
        recs.append(rec)
        if cuda:
            torch.cuda.empty_cache()
        if "speedup" in rec:
            log(f"  KB check {'pass' if rec['kb_ok'] else 'FAIL'}; eager {rec['eager_ms']:.3f} ms, "
                f"fused {rec['fused_ms']:.3f} ms ({rec['speedup']:.2f}x); host "
                f"{rec['fused_host_us']:.1f} us a call (eager {rec['eager_host_us']:.1f})")
        elif "kb_ok" in rec:
            log(f"  check {'pass' if rec['kb_ok'] else 'FAIL'} (max abs err {rec['kb_max_abs']:.1e})")
        if "train_speedup" in rec:
            log(f"  training step: gradients {'pass' if rec['grad_ok'] else 'FAIL'}; eager "
                f"{rec['train_eager_ms']:.3f} ms, fused {rec['train_fused_ms']:.3f} ms "
                f"({rec['train_speedup']:.2f}x)")
        elif "grad_ok" in rec:
            log(f"  gradients {'pass' if rec['grad_ok'] else 'FAIL'}")
    table = format_rows(recs)
    log("")
    log(table)
    if train:
        log("")
        log(format_train_rows(recs))
    if json_path:
        meta = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        Path(json_path).write_text(json.dumps({"meta": meta, "results": recs}, indent=1, default=str))
    bad = [r for r in recs if r.get("kb_ok") is False or r.get("grad_ok") is False
           or "error" in r]
    return 1 if bad else 0
