"""Why a fused module's specialised call (cupyfuse/fastpath.py) declines: after warm-up
calls, its source with each ``return None`` made to return the line it is on, run on the
same call. Prints, per case, whether the function exists and which check declines (or
"used"). The sweep's host-cost models at batch 32, 512 x 512, in grad mode and no_grad.
PYTHONPATH=.:tools python tools/spec_why.py"""
import torch

from cupyfuse import bench_sweep
from cupyfuse import nn as cnn


def why(fm, x):
    d = fm.__dict__
    runner = d.get("_runner", d.get("_cupyfuse_runner"))
    spec = runner._spec
    if spec is None:
        return f"no specialised call (key {runner._spec_key is not None})"
    lines = spec.source.splitlines()
    out = []
    for i, ln in enumerate(lines):
        out.append(ln.replace("return None", f"return ('declined', {i})"))
    ns = dict(spec.__globals__)
    exec(compile("\n".join(out) + "\n", "<why>", "exec"), ns)
    r = ns["specialised"](fm, (x,))
    if isinstance(r, tuple) and r and r[0] == "declined":
        return f"declines at: {lines[r[1]].strip()}"
    return "used"


def main():
    dev = torch.device("cuda")
    for prob in ("gen", "56"):
        torch.manual_seed(0)
        fm = cnn.from_model(bench_sweep._model(prob, 512, dev))
        x = torch.randn(32, 512, device=dev)
        for grad in (True, False):
            with torch.enable_grad() if grad else torch.no_grad():
                for _ in range(5):
                    fm(x)
                print(f"{prob} {'grad' if grad else 'no_grad'}: {type(fm).__name__}: {why(fm, x)}",
                      flush=True)


main()
