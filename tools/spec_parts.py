"""Where a specialised call's time goes (cupyfuse/fastpath.py): the generated function cut
after each of its statements (``return None`` appended), timed in a tight loop; the
differences between successive cuts are each statement's cost. Also the layers above
it: the module's ``__call__``, ``_Runner.fast_call``. Batch 32, 512 x 512 (the sweep's
host-cost case), fused_class and from_model modules, under no_grad.
PYTHONPATH=.:tools python tools/spec_parts.py"""
import time

import torch

from cupyfuse import models
from cupyfuse import nn as cnn


def per_call(fn, n=2000, rounds=7):
    for _ in range(200):
        fn()
    best = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    best.sort()
    return best[len(best) // 2]


def cuts(src):
    """(line number, source) of the function cut after each top-level statement."""
    lines = src.splitlines()
    body = lines[1:]
    out = [(0, lines[0] + "\n    return None\n")]
    for i, ln in enumerate(body):
        nxt = body[i + 1] if i + 1 < len(body) else ""
        if ln.strip() == "try:" or ln.startswith("        ") or nxt.startswith("    except"):
            continue
        if ln.strip().startswith("return "):
            continue
        out.append((i + 1, "\n".join(lines[:i + 2]) + "\n    return None\n"))
    return out


def main():
    d = torch.device("cuda", 0)
    torch.manual_seed(0)
    orig = models.MatmulSigmoidSum(512, 512).to(d)
    fc = cnn.from_model(orig)
    x = torch.randn(32, 512, device=d)
    with torch.no_grad():
        for _ in range(5):
            fc(x)
        runner = fc.__dict__["_cupyfuse_runner"]
        spec = runner._spec
        assert spec is not None, "no specialised call"
        model, args, prec = fc, (x,), None   # (a fused_class instance: its own module)
        print(f"{torch.cuda.get_device_name()}; us per call")
        print(f"  module call                 {per_call(lambda: fc(x)):6.2f}")
        print(f"  runner.fast_call            {per_call(lambda: runner.fast_call(model, args, prec)):6.2f}")
        print(f"  specialised call            {per_call(lambda: spec(fc, args)):6.2f}")
        print(f"  torch.empty(32, 1)          {per_call(lambda: torch.empty(32, 1, device=d)):6.2f}")
        body = spec.source.splitlines()
        prev = 0.0
        for ln, src in cuts(spec.source):
            ns = spec.__globals__
            exec(compile(src, "<cut>", "exec"), ns)
            cut = ns["specialised"]
            t = per_call(lambda: cut(fc, args))
            print(f"  {t:6.2f} (+{t - prev:5.2f})  {body[ln].strip()[:90] if ln else '(entry)'}")
            prev = t


main()
