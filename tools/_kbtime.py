"""The cold-L2 timers the GPU probes share (certify_probe.py, defs_probe.py, kb_headstart.py):
KernelBench's way (L2 flushed before each call, CUDA events, median) and the GPU time per
call of each kernel (torch.profiler)."""
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


def timed(fn, reps: int, cold: bool = True) -> float:
    """Median ms of ``fn()`` over ``reps`` calls after 3 warm-up calls, L2 flushed before
    each (``cold``)."""
    ts = []
    for _ in range(reps + 3):
        if cold:
            flush_l2()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts[3:])


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
