"""The cold-L2 timers the GPU probes share (certify_probe.py, defs_probe.py, kb_headstart.py,
cert_knobs_probe.py, kb_host_probe.py): KernelBench's way (L2 flushed before each call,
CUDA events, median), optionally with a GPU sleep before the start event (a head start:
the GPU's time whatever the host's speed), the GPU time per call of each kernel
(torch.profiler), and a KernelBench file's module."""
import glob
import importlib.util
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

_flush: torch.Tensor | None = None


def flush_l2() -> None:
    """Overwrite 256 MB (past the L2 of any current GPU)."""
    global _flush
    if _flush is None:
        _flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    _flush.zero_()


_cyc_per_us: float | None = None


def _sleep_us(us: float) -> None:
    """Queue a GPU sleep of about ``us`` microseconds (torch.cuda._sleep, cycles measured
    once)."""
    global _cyc_per_us
    if _cyc_per_us is None:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        torch.cuda._sleep(1_000_000)
        ev[1].record()
        torch.cuda.synchronize()
        _cyc_per_us = 1_000_000 / (ev[0].elapsed_time(ev[1]) * 1e3)
    torch.cuda._sleep(int(us * _cyc_per_us))


def timed(fn, reps: int, cold: bool = True, sleep_us: float = 0.0, warm: int = 3) -> float:
    """Median ms of ``fn()`` over ``reps`` calls after ``warm`` warm-up calls, L2 flushed
    before each (``cold``), a GPU sleep of ``sleep_us`` queued before the start event
    where given (a head start for the host)."""
    ts = []
    for _ in range(reps + warm):
        if cold:
            flush_l2()
        if sleep_us:
            _sleep_us(sleep_us)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts[warm:])


def kernel_times(fn, reps: int = 10) -> dict[str, float]:
    """GPU time per call (us) of each kernel ``fn()`` launches, L2 flushed before each
    call (the flush's own kernel left out)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush_l2()
            fn()
        torch.cuda.synchronize()
    rows: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and \
                "FillFunctor<unsigned char>" not in e.name:
            rows[e.name] = rows.get(e.name, 0.0) + e.device_time / reps
    return rows


def kb_module(name: str):
    """The module of tests/kernelbench/l2_<name>_*.py (its Model, get_inputs,
    get_init_inputs)."""
    path = glob.glob(f"tests/kernelbench/l2_{name}_*.py")[0]
    spec = importlib.util.spec_from_file_location("kb", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
