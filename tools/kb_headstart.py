"""Is a model's KernelBench time its GPU's or its host's? KB timing (L2 flushed, events
around the call, median) as KernelBench does it, beside the same with a GPU sleep queued
before the start event (the host gets a head start of ~--sleep-us: its launches are
queued before the GPU reaches them), in grad mode and under no_grad, alternated; plus the
host time per call. Usage: PYTHONPATH=.:tools python tools/kb_headstart.py [98 ...]"""
import argparse

import torch

import cupyfuse
from cupyfuse import nn as cnn
from _hosttime import us
from _kbtime import kb_module, timed

ap = argparse.ArgumentParser()
ap.add_argument("names", nargs="*", default=["98"])
ap.add_argument("--reps", type=int, default=60)
ap.add_argument("--sleep-us", type=float, default=300.0)
ap.add_argument("--plain", action="store_true",
                help="runtime.DEPENDENT_LAUNCHES = False (no programmatic dependent launches)")
opts = ap.parse_args()
dev = torch.device("cuda")
if opts.plain:
    from cupyfuse import runtime
    runtime.DEPENDENT_LAUNCHES = False
print(torch.cuda.get_device_name(), flush=True)


def kb(f, x, head: bool) -> float:
    """KB timing in us, a head start of --sleep-us where ``head``."""
    return timed(lambda: f(x), opts.reps, sleep_us=opts.sleep_us if head else 0.0, warm=5) * 1e3


def builds(name):
    """(label, fused callable, x): cnn.from_model of the model, and fused_class of the
    KernelBench file's Model as `bench --model` builds it"""
    mod = kb_module(name)
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs()).to(dev)
    torch.manual_seed(3000)
    x = mod.get_inputs()[0].to(dev)
    yield "from_model", cnn.from_model(model), x
    torch.manual_seed(0)
    yield "fused_class", cupyfuse.fused_class(mod.Model)(*mod.get_init_inputs()).to(dev), x


for name, (label, f, x) in ((n, b) for n in opts.names for b in builds(n)):
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for _ in range(10):
                f(x)
            host = us(lambda: f(x), n=200, rounds=3)
            rows = [(kb(f, x, False), kb(f, x, True)) for _ in range(3)]
            print(f"{name} {label} grad={grad}: host per call {host:.1f} us; KB us (plain / head start): "
                  + ", ".join(f"{p:.1f} / {h:.1f}" for p, h in rows), flush=True)
