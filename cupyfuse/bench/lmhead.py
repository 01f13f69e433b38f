"""``cupyfuse bench --lm-head``: a language-model head and its cross entropy,
``F.cross_entropy(F.linear(x, W), y)``, forward and training step, at tokens x hidden ->
vocabulary: cupyfuse.linear_cross_entropy against eager, torch.compile, Liger-Kernel's
``LigerFusedLinearCrossEntropyLoss`` (when importable) and the three GEMMs alone
(logits, dx, dW), all in one run. Time is the median of CUDA-event-timed runs; peak memory
is the most allocated during a call beyond what was allocated before it (inputs and weights
resident, gradients cleared). Each variant's loss and gradients are compared with a float64
reference (computed in token chunks), beside eager's own error.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _median_ms(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def _peak_gib(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _reference(x: torch.Tensor, W: torch.Tensor, y: torch.Tensor, chunk: int = 512) -> tuple:
    """float64 loss (mean), dx and dW, in token chunks."""
    T = x.shape[0]
    W64 = W.double()
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    dx = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    dW = torch.zeros(W.shape, dtype=torch.float64, device=x.device)
    for t0 in range(0, T, chunk):
        xc = x[t0:t0 + chunk].double()
        z = xc @ W64.t()
        lse = torch.logsumexp(z, 1)
        yc = y[t0:t0 + chunk]
        loss += (lse - z.gather(1, yc[:, None])[:, 0]).sum()
        p = torch.softmax(z, 1)
        p[torch.arange(len(yc), device=x.device), yc] -= 1.0
        p /= T
        dx[t0:t0 + chunk] = p @ W64
        dW += p.t() @ xc
        del z, p
    return loss / T, dx, dW


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    scale = max(1.0, ref.abs().max().item())
    return (a.double() - ref).abs().max().item() / scale


def _variants(compile_: bool) -> dict[str, Callable]:
    from cupyfuse.lmhead import linear_cross_entropy

    def eager(x: torch.Tensor, W: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(x, W), y)

    out: dict[str, Callable] = {"eager": eager}
    if compile_:
        out["torch.compile"] = torch.compile(eager)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda x, W, y: liger(W, x, y)
    except Exception as exc:  # pragma: no cover - depends on the install
        print(f"cupyfuse bench --lm-head: Liger-Kernel not importable ({exc.__class__.__name__}: "
              f"{exc}); its rows are left out", file=sys.stderr)
    out["cupyfuse"] = lambda x, W, y: linear_cross_entropy(x, W, y)
    # the same with chunks four times larger (fewer, larger GEMMs; more memory)
    def big_chunks(x: torch.Tensor, W: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from cupyfuse.lmhead import chunk_rows_for

        vc = 4 * chunk_rows_for(x.shape[0], x.shape[1], x.element_size(), W.shape[0])
        return linear_cross_entropy(x, W, y, chunk_rows=vc)

    out["cupyfuse, 4x chunks"] = big_chunks
    return out


def bench_shape(T: int, H: int, V: int, dtype: torch.dtype, reps: int, compile_: bool,
                check: bool = True) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=dtype, generator=g)
    W = (torch.randn(V, H, device=dev, dtype=torch.float32, generator=g) * H ** -0.5).to(dtype)
    y = torch.randint(0, V, (T,), device=dev, generator=g)
    ref = _reference(x, W, y) if check else None
    rows = []
    # the three GEMMs alone, on a random (T, V) gradient in the operands' dtype
    G = torch.randn(T, V, device=dev, dtype=dtype, generator=g)
    fwd = lambda: torch.mm(x, W.t())
    three = lambda: (torch.mm(x, W.t()), torch.mm(G, W), torch.mm(G.t(), x))
    rows.append({"variant": "three GEMMs", "forward_ms": _median_ms(fwd, reps),
                 "step_ms": _median_ms(three, reps), "forward_gib": _peak_gib(fwd),
                 "step_gib": _peak_gib(three)})
    del G
    torch.cuda.empty_cache()
    for name, fn in _variants(compile_).items():
        print(f"  {name} ...", file=sys.stderr, flush=True)
        xg = x.detach().clone().requires_grad_()
        Wg = W.detach().clone().requires_grad_()

        def forward() -> Any:
            with torch.no_grad():
                return fn(x, W, y)

        def step() -> Any:
            xg.grad = Wg.grad = None
            loss = fn(xg, Wg, y)
            loss.backward()
            return loss

        try:
            rec: dict[str, Any] = {"variant": name}
            loss = step()
            if ref is not None:
                rec["loss_err"] = abs(loss.double().item() - ref[0].item()) / max(1.0, abs(ref[0].item()))
                rec["dx_err"] = _err(xg.grad, ref[1])
                rec["dw_err"] = _err(Wg.grad, ref[2])
            rec["forward_ms"] = _median_ms(forward, reps)
            rec["step_ms"] = _median_ms(step, reps)
            xg.grad = Wg.grad = None
            rec["forward_gib"] = _peak_gib(forward)
            rec["step_gib"] = _peak_gib(step)
        except Exception as exc:   # a peer failing at a size is a row, not the end of the run
            rec = {"variant": name, "error": f"{exc.__class__.__name__}: {str(exc)[:200]}"}
        rows.append(rec)
        del xg, Wg
        torch.cuda.empty_cache()
    for r in rows:
        r.update(tokens=T, hidden=H, vocab=V, dtype=str(dtype).replace("torch.", ""))
    return rows


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| tokens x hidden -> vocab | variant | forward ms | step ms | step / 3 GEMMs | "
           "step peak GiB | forward peak GiB | loss err | dx err | dW err |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    base: dict[tuple, float] = {}
    for r in rows:
        if r["variant"] == "three GEMMs":
            base[(r["tokens"], r["vocab"])] = r["step_ms"]
    for r in rows:
        shape = f"{r['tokens']} x {r['hidden']} -> {r['vocab']} ({r['dtype']})"
        if "error" in r:
            out.append(f"| {shape} | {r['variant']} | {r['error']} |||||||")
            continue
        b = base.get((r["tokens"], r["vocab"]))
        e = lambda k: f"{r[k]:.1e}" if k in r else "-"
        out.append(f"| {shape} | {r['variant']} | {r['forward_ms']:.2f} | {r['step_ms']:.2f} | "
                   f"{r['step_ms'] / b:.3f}x | {r['step_gib']:.2f} | {r['forward_gib']:.2f} | "
                   f"{e('loss_err')} | {e('dx_err')} | {e('dw_err')} |")
    return "\n".join(out)


def run_lm_head_bench(tokens: Sequence[int] = (4096, 16384), hidden: int = 4096,
                      vocabs: Sequence[int] = (128256, 32000), dtype: str = "bf16",
                      reps: int = 20, compile_: bool = True, json_path: str | None = None) -> int:
    if not torch.cuda.is_available():
        print("cupyfuse bench --lm-head needs a CUDA GPU (the CPU path is checked by the "
              "tests: tests/api/test_lmhead.py)", file=sys.stderr)
        return 1
    rows: list[dict[str, Any]] = []
    for V in vocabs:
        for T in tokens:
            t0 = time.perf_counter()
            print(f"cupyfuse bench --lm-head: {T} x {hidden} -> {V} ({dtype})", file=sys.stderr,
                  flush=True)
            rows += bench_shape(T, hidden, V, DTYPES[dtype], reps, compile_)
            print(f"  done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(format_rows(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    return 0
