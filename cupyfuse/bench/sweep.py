"""``python -m cupyfuse bench --sweep``: every calling mode over a shape grid.

The grid of the project's performance targets: the four models (``cupyfuse.kernelbench.models``,
fused with ``cupyfuse.from_model``) and a generic one ("gen": Linear, GELU, softmax) x batch {1, 8, 64, 512, 4096} x features (in = out) {1024, 4096, 16384},
each called

* ``module_nograd``: the fused module under ``torch.no_grad()``, vs the original module;
* ``module_grad``: both in grad mode with parameters requiring grad (KernelBench's way);

plus ``matmul_sigmoid_sum`` called directly over batch x features:

* ``function_torch``: ``cupyfuse.kernelbench.matmul_sigmoid_sum`` vs the same math in torch ops;
* ``function_cupy``: the same with CuPy arrays (the weight wrapped once with
  ``cupyfuse.prepare_weight``, the documented way to keep its derived copies) vs the
  same math in CuPy;
* ``function_cupy_plain``: the same with the plain CuPy weight (nothing keeps its
  derived copies: see ``cupyfuse.backend.gemm.uncached``).

Each cell: median ms of both, timed interleaved call by call (which side goes first
alternates, so a slow stretch of a noisy host lands on both), CUDA events around each call, L2 flushed
before each call, warm-up first; and speedup = baseline / cupyfuse (> 1: cupyfuse faster). Then the host
cost per call at a launch-bound size (batch 32, 512 x 512): a tight loop of calls,
``perf_counter`` around it, one synchronisation at the end. Writes a JSON file and a
heat map PNG (one panel per mode) and prints a table. Cells that do not fit in memory
are reported as skipped. Without a GPU it says so and returns 2 unless ``allow_cpu``
(the tests use tiny CPU grids to check the plumbing).
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import cupyfuse.kernelbench  # noqa: F401  (the named ops the function cells call)

__all__ = ["run_sweep", "DEFAULT_BATCHES", "DEFAULT_FEATURES", "MODES"]

DEFAULT_BATCHES = (1, 8, 64, 512, 4096)
DEFAULT_FEATURES = (1024, 4096, 16384)
MODES = ("module_nograd", "module_grad", "function_torch", "function_cupy",
         "function_cupy_plain")
#: hyper-parameters of the four models besides (in, out)
_EXTRA = {"55": (2, 0.5), "56": (), "98": (16, 2.0), "39": None}


def _init_args(problem: str, f: int) -> tuple:
    if problem == "39":
        return (f, f, (f,))
    if problem == "gen":
        return (f, f)
    return (f, f) + _EXTRA[problem]


class GeluSoftmax(torch.nn.Module):
    """A Linear + tail model none of the named ops covers (problem "gen" of the grid): it
    runs as the generic program (cupyfuse.from_model)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(torch.nn.functional.gelu(self.linear(x)), dim=1)


def _model(problem: str, f: int, device: torch.device) -> torch.nn.Module:
    from cupyfuse.kernelbench import models

    cls = GeluSoftmax if problem == "gen" else models.PROBLEMS[problem].model
    with torch.device(device):   # initialised where it runs (a 16384^2 init on the CPU: s)
        return cls(*_init_args(problem, f))


_last_model: dict[tuple, Any] = {}


PairTimer = Callable[[Callable[[], Any], Callable[[], Any], int], tuple[float, float]]


def _timer(device: torch.device) -> PairTimer:
    """``timer(baseline, ours, reps)`` -> (median ms, median ms): the two interleaved call
    by call (which goes first alternates), so a slow stretch of the host or the GPU
    lands on both sides alike; on CUDA each call after an L2 flush, timed with events."""
    if device.type != "cuda":
        def cpu_pair(fa: Callable[[], Any], fb: Callable[[], Any], reps: int
                     ) -> tuple[float, float]:
            fa()
            fb()
            ts: tuple[list[float], list[float]] = ([], [])
            for i in range(reps):
                for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                    t0 = time.perf_counter()
                    (fa, fb)[j]()
                    ts[j].append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts[0]), statistics.median(ts[1])
        return cpu_pair
    flush = torch.empty(int(64e6), dtype=torch.float32, device=device)  # 256 MB > L2

    def gpu_pair(fa: Callable[[], Any], fb: Callable[[], Any], reps: int
                 ) -> tuple[float, float]:
        for _ in range(3):
            fa()
            fb()
        ev = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(reps)] for _ in range(2)]
        for i in range(reps):
            for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                flush.zero_()
                ev[j][i][0].record()
                (fa, fb)[j]()
                ev[j][i][1].record()
        torch.cuda.synchronize(device)
        return tuple(statistics.median(s.elapsed_time(e) for s, e in ev[j])  # type: ignore
                     for j in (0, 1))
    return gpu_pair


def _host_us(fn: Callable[[], Any], device: torch.device, n: int | None = None,
             rounds: int | None = None) -> float:
    """Host time per call: a tight loop of ``n`` calls, ``perf_counter`` around the loop
    alone (the caller's time: the device is synchronised before each loop and after it,
    outside the timing; at a launch-bound size the GPU keeps pace, so this is also the
    wall time); the median of ``rounds`` loops (the host is noisy). On the CPU (a check of
    the plumbing, not a figure) 20 calls and 2 loops."""
    cpu = device.type != "cuda"
    n = n if n is not None else (20 if cpu else 200)
    rounds = rounds if rounds is not None else (2 if cpu else 5)
    for _ in range(2 if cpu else 5):
        fn()
    out = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return statistics.median(out)


def _fits(batch: int, f: int, device: torch.device) -> bool:
    need = 4 * (f * f * 3 + batch * f * 4)  # weight + derived copies + activations
    if device.type != "cuda":
        return need < 2e9
    free, _ = torch.cuda.mem_get_info(device)
    return need < 0.8 * free


def _module_cell(problem: str, batch: int, f: int, mode: str, device: torch.device,
                 timer: Callable, reps: int) -> dict[str, Any]:
    from cupyfuse import from_model

    key = (problem, f, str(device))
    if key not in _last_model:   # one model per (problem, features), kept across batches
        _last_model.clear()
        torch.manual_seed(0)
        orig = _model(problem, f, device)
        _last_model[key] = (orig, from_model(orig))
    orig, fused = _last_model[key]
    orig.train()
    fused.train()
    x = torch.rand(batch, f, device=device)
    if problem == "39" and batch == 1:
        orig.eval()
        fused.eval()
    if mode == "module_nograd":
        with torch.no_grad():
            base, ours = timer(lambda: orig(x), lambda: fused(x), reps)
    else:
        base, ours = timer(lambda: orig(x), lambda: fused(x), reps)
    return {"baseline_ms": base, "cupyfuse_ms": ours}


def _function_cell(batch: int, f: int, mode: str, device: torch.device, timer: Callable,
                   reps: int) -> dict[str, Any]:
    import cupyfuse

    torch.manual_seed(0)
    x = torch.rand(batch, f, device=device)
    w = (torch.rand(f, f, device=device) - 0.5) / math.sqrt(f)
    b = torch.rand(f, device=device) - 0.5
    if mode == "function_torch":
        base, ours = timer(lambda: torch.sigmoid(torch.addmm(b, x, w.t())).sum(1, keepdim=True),
                           lambda: cupyfuse.kernelbench.matmul_sigmoid_sum(x, w, b), reps)
        return {"baseline_ms": base, "cupyfuse_ms": ours}
    import cupy

    xc, wc, bc = cupy.asarray(x), cupy.asarray(w), cupy.asarray(b)

    def cupy_math() -> Any:
        return (1 / (1 + cupy.exp(-(xc @ wc.T + bc)))).sum(axis=1, keepdims=True)

    # the weight wrapped once: the documented way to keep a CuPy weight's derived copies
    pw = cupyfuse.prepare_weight(wc) if mode == "function_cupy" else wc
    base, ours = timer(cupy_math, lambda: cupyfuse.kernelbench.matmul_sigmoid_sum(xc, pw, bc), reps)
    return {"baseline_ms": base, "cupyfuse_ms": ours}


def run_sweep(problems: Sequence[str] = ("55", "56", "98", "39", "gen"),
              batches: Sequence[int] = DEFAULT_BATCHES,
              features: Sequence[int] = DEFAULT_FEATURES, modes: Sequence[str] = MODES,
              reps: int = 20, json_path: str | None = None, plot_path: str | None = None,
              allow_cpu: bool = False, stdout: Any = None) -> int:
    """Run the grid; returns 0 when every cell ran, 1 if some failed, 2 without a GPU."""
    import warnings

    with warnings.catch_warnings():
        # grad-mode cells are meant to run with parameters requiring grad
        warnings.filterwarnings("ignore", message=r".*is forward-only")
        return _run_sweep(problems, batches, features, modes, reps, json_path, plot_path,
                          allow_cpu, stdout)


def _run_sweep(problems: Sequence[str], batches: Sequence[int], features: Sequence[int],
               modes: Sequence[str], reps: int, json_path: str | None, plot_path: str | None,
               allow_cpu: bool, stdout: Any) -> int:
    out = stdout or sys.stdout
    cuda = torch.cuda.is_available()
    if not cuda and not allow_cpu:
        print("bench --sweep: needs a CUDA GPU (timings of every calling mode); none here",
              file=out)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    timer = _timer(device)
    cells: list[dict[str, Any]] = []
    grid = []
    for mode in modes:
        probs = problems if mode.startswith("module") else ("56",)
        for p in probs:
            for f in features:
                for bt in batches:
                    grid.append((mode, p, f, bt))
    failed = 0
    for k, (mode, p, f, bt) in enumerate(grid, 1):
        rec: dict[str, Any] = {"mode": mode, "problem": p, "features": f, "batch": bt}
        print(f"[{k}/{len(grid)}] {mode} {p} batch {bt} features {f}", file=out, flush=True)
        if not _fits(bt, f, device):
            rec["skipped"] = "does not fit in memory"
        else:
            try:
                if mode.startswith("module"):
                    rec.update(_module_cell(p, bt, f, mode, device, timer, reps))
                else:
                    if mode.startswith("function_cupy") and not cuda:
                        rec["skipped"] = "CuPy needs a GPU"
                    else:
                        rec.update(_function_cell(bt, f, mode, device, timer, reps))
            except Exception as exc:  # report the cell and go on
                rec["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                failed += 1
        if "cupyfuse_ms" in rec:
            rec["speedup"] = rec["baseline_ms"] / rec["cupyfuse_ms"]
            print(f"    baseline {rec['baseline_ms']:.4f} ms, cupyfuse {rec['cupyfuse_ms']:.4f} ms, "
                  f"{rec['speedup']:.2f}x", file=out, flush=True)
        cells.append(rec)
    _last_model.clear()
    if cuda:
        torch.cuda.empty_cache()
    host = _host_costs(device, cuda)
    _print_table(cells, host, out)
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "reps": reps}
    if json_path:
        Path(json_path).write_text(json.dumps({"meta": meta, "cells": cells, "host_us": host},
                                              indent=1))
    if plot_path:
        write_heatmap(cells, plot_path, meta)
    return 1 if failed else 0


def _host_costs(device: torch.device, cuda: bool) -> dict[str, float]:
    """Host time per call (us) at batch 32, 512 x 512, for each calling mode."""
    import cupyfuse
    from cupyfuse.kernelbench import models
    from cupyfuse import from_model

    res: dict[str, float] = {}
    torch.manual_seed(0)
    orig = models.MatmulSigmoidSum(512, 512).to(device)
    fused = from_model(orig)
    x = torch.rand(32, 512, device=device)
    w, b = orig.linear.weight.detach(), orig.linear.bias.detach()
    with torch.no_grad():
        res["eager_nograd"] = _host_us(lambda: orig(x), device)
        res["module_nograd"] = _host_us(lambda: fused(x), device)
    res["eager_grad"] = _host_us(lambda: orig(x), device)
    res["module_grad"] = _host_us(lambda: fused(x), device)
    res["function_torch"] = _host_us(lambda: cupyfuse.kernelbench.matmul_sigmoid_sum(x, w, b), device)
    torch.manual_seed(0)
    gen = _model("gen", 512, device)
    fgen = from_model(gen)
    res["generic_module_grad"] = _host_us(lambda: fgen(x), device)
    with torch.no_grad():
        res["generic_module_nograd"] = _host_us(lambda: fgen(x), device)
    res["generic_function_torch"] = _host_us(lambda: cupyfuse.fused_linear(x, w, b, _gelu_softmax),
                                             device)
    if cuda:
        import cupy

        xc, wc, bc = cupy.asarray(x), cupy.asarray(w), cupy.asarray(b)
        pw = cupyfuse.prepare_weight(wc)
        res["function_cupy"] = _host_us(lambda: cupyfuse.kernelbench.matmul_sigmoid_sum(xc, pw, bc), device)
        res["function_cupy_plain"] = _host_us(
            lambda: cupyfuse.kernelbench.matmul_sigmoid_sum(xc, wc, bc), device)
        res["generic_function_cupy"] = _host_us(
            lambda: cupyfuse.fused_linear(xc, pw, bc, _gelu_softmax), device)
    return res


def _gelu_softmax(h: torch.Tensor) -> torch.Tensor:
    return torch.softmax(torch.nn.functional.gelu(h), dim=1)


def _print_table(cells: Sequence[dict[str, Any]], host: dict[str, float], out: Any) -> None:
    print("", file=out)
    print("| mode | problem | features | batch | baseline ms | cupyfuse ms | speedup |", file=out)
    print("|---|---|---|---|---|---|---|", file=out)
    for c in cells:
        if "speedup" in c:
            print(f"| {c['mode']} | {c['problem']} | {c['features']} | {c['batch']} | "
                  f"{c['baseline_ms']:.4f} | {c['cupyfuse_ms']:.4f} | {c['speedup']:.2f}x |",
                  file=out)
        else:
            print(f"| {c['mode']} | {c['problem']} | {c['features']} | {c['batch']} | "
                  f"{c.get('skipped') or c.get('error')} | | |", file=out)
    slower = [c for c in cells if c.get("speedup", math.inf) < 1.0]
    timed = [c for c in cells if "speedup" in c]
    print(f"\ncells where cupyfuse is slower than its baseline: {len(slower)} of {len(timed)}",
          file=out)
    print("host cost per call (batch 32, 512 x 512), us: " +
          ", ".join(f"{k} {v:.1f}" for k, v in host.items()), file=out)


def write_heatmap(cells: Sequence[dict[str, Any]], path: str, meta: dict[str, Any]) -> bool:
    """One panel per mode: rows (problem, features), columns batch, colour log2(speedup)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench --sweep: matplotlib is not installed; no heat map", file=sys.stderr)
        return False
    modes = [m for m in MODES if any(c["mode"] == m for c in cells)]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 5.5), squeeze=False,
                             constrained_layout=True)
    for ax, mode in zip(axes[0], modes):
        mc = [c for c in cells if c["mode"] == mode]
        rows = sorted({(c["problem"], c["features"]) for c in mc})
        cols = sorted({c["batch"] for c in mc})
        grid = [[math.nan] * len(cols) for _ in rows]
        for c in mc:
            if "speedup" in c:
                grid[rows.index((c["problem"], c["features"]))][cols.index(c["batch"])] = \
                    math.log2(c["speedup"])
        im = ax.imshow(grid, cmap="RdYlGn", vmin=-3, vmax=3, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{2 ** v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(cols)), [str(b) for b in cols])
        ax.set_yticks(range(len(rows)), [f"{p} / {f}" for p, f in rows])
        ax.set_xlabel("batch")
        ax.set_title(mode)
    fig.colorbar(im, ax=axes[0].tolist(), label="log2(speedup over baseline)")
    fig.suptitle(f"cupyfuse speedup per calling mode ({meta['device']}, {meta['date']})")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
