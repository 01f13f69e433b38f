"""One KernelBench model's fused output taken apart against float64 and eager fp32: the first
call (general path), repeated calls (prepared launches), the general path forced, and the
program without rewrites. Usage: PYTHONPATH=. python tools/diag_kb.py 14 [18 ...]"""
import sys

import torch

import cupyfuse
from cupyfuse import fused as fz, rewrite
from tests.kernelbench.index import load, path_of

torch.backends.cuda.matmul.allow_tf32 = False


def err(name, out, r64):
    o = out.detach().double()
    d = (o - r64).abs()
    tol = 1e-4 + 1e-4 * r64.abs()
    bad = (d > tol).sum().item()
    i = int(d.argmax())
    print(f"  {name:28s} max abs {d.max().item():.3e}  bad {bad:6d}/{d.numel()}  "
          f"worst idx {i}: got {o.flatten()[i].item():.6g} ref {r64.flatten()[i].item():.6g}")


for num in map(int, sys.argv[1:]):
    mod = load(path_of(num))
    print(f"== KB {num}")
    init = mod.get_init_inputs()
    torch.manual_seed(0)
    orig = mod.Model(*init).cuda()
    torch.manual_seed(0)
    f = cupyfuse.fused_class(mod.Model)(*init).cuda()
    torch.manual_seed(1000)
    xs = [t.cuda() for t in mod.get_inputs()]
    r64 = orig.double()(*[t.double() for t in xs]).double()
    orig.float()
    err("eager fp32", orig(*xs), r64)
    err("fused call 1", f(*xs), r64)
    for c in range(2, 4):
        err(f"fused call {c}", f(*xs), r64)
    saved = fz._prep.usable
    fz._prep.usable = lambda p: None
    torch.manual_seed(0)
    g = cupyfuse.fused_class(mod.Model)(*init).cuda()
    for c in range(1, 3):
        err(f"general path call {c}", g(*xs), r64)
    fz._prep.usable = saved
    rules = rewrite.RULES
    rewrite.RULES = ()
    torch.manual_seed(0)
    g = cupyfuse.fused_class(mod.Model)(*init).cuda()
    for c in range(1, 3):
        err(f"no rewrites call {c}", g(*xs), r64)
    rewrite.RULES = rules
    progs = list(f._runner.programs.values()) if hasattr(f, "_runner") else []
    for p in progs[:1]:
        print("  program:", [(n.kind, n.attrs[:2] if n.attrs else None) for n in p.nodes][:12])
