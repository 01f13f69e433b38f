"""The host time of one fused call as KernelBench makes it (L2 flush queued, start event,
the call, end event, synchronize), per model, grad mode and no_grad: perf_counter around
the call alone (median), and a cProfile of those calls (where the time goes).
Usage: PYTHONPATH=.:tools python tools/kb_host_probe.py [98 ...] [--reps N] [--top N]"""
import argparse
import cProfile
import pstats
import statistics
import time

import torch

from cupyfuse import nn as cnn
from _kbtime import flush_l2, kb_module

ap = argparse.ArgumentParser()
ap.add_argument("names", nargs="*", default=["98"])
ap.add_argument("--reps", type=int, default=100)
ap.add_argument("--top", type=int, default=25)
opts = ap.parse_args()
print(torch.cuda.get_device_name(), flush=True)
for name in opts.names:
    mod = kb_module(name)
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs()).cuda()
    x = mod.get_inputs()[0].cuda()
    f = cnn.from_model(model)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for _ in range(5):
                f(x)
            torch.cuda.synchronize()

            def call(prof=None):
                flush_l2()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                if prof is not None:
                    prof.enable()
                t = time.perf_counter()
                f(x)
                t = time.perf_counter() - t
                if prof is not None:
                    prof.disable()
                b.record()
                torch.cuda.synchronize()
                return t * 1e6, a.elapsed_time(b) * 1e3

            rows = [call() for _ in range(opts.reps)]
            print(f"{name} grad={grad}: host {statistics.median(r[0] for r in rows):.1f} us "
                  f"(min {min(r[0] for r in rows):.1f}), KB {statistics.median(r[1] for r in rows):.1f} us",
                  flush=True)
            if grad:
                pr = cProfile.Profile()
                for _ in range(opts.reps):
                    call(pr)
                pstats.Stats(pr).sort_stats("tottime").print_stats(opts.top)
