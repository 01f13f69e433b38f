"""The tight-loop host timer the host probes share (tools/host_parts.py, host_module.py, kb_headstart.py)."""
import statistics
import time

import torch


def us(fn, n=2000, rounds=7):
    """Microseconds per call of ``fn``: ``n`` calls in a loop, the median of ``rounds``
    loops, the device synchronised after each loop."""
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)
