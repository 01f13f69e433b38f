"""The named ops' hand-built paths (ops.py / plans.py / row_tail.cu) against the generic
program of the same math (fused_linear with the op's tail), per problem and size: KB timing
(L2 flushed, CUDA events, median), parameters requiring grad, and the max difference of
the two results. PYTHONPATH=. python tools/retire_probe.py"""
import sys
import types

import torch
from torch.profiler import ProfilerActivity, profile

from cupyfuse import fused, models, ops
from cupyfuse.bench_model import time_kb

dev = torch.device("cuda")
CASES = [("55", 128, 32768, 32768, 2, 0.5), ("56", 128, 32768, 32768, 0, 1.0),
         ("98", 1024, 8192, 8192, 16, 2.0),
         ("55", 4096, 4096, 4096, 2, 0.5), ("56", 4096, 4096, 4096, 0, 1.0),
         ("98", 4096, 4096, 4096, 16, 2.0), ("55", 1024, 8192, 8192, 4, 0.5),
         ("56", 16384, 1024, 1024, 0, 1.0), ("98", 64, 16384, 16384, 16, 2.0)]
print("| op | batch | K | N | k | hand ms | generic ms | generic/hand | max |diff| |")
print("|---|---|---|---|---|---|---|---|---|")
for op, M, K, N, k, s in CASES:
    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.rand(N, K, device=dev) * 2 - 1) / K ** 0.5)
    b = torch.nn.Parameter((torch.rand(N, device=dev) * 2 - 1) / K ** 0.5)
    x = torch.rand(M, K, device=dev)
    if op == "55":
        hand = lambda: ops.matmul_maxpool_sum_scale(x, w, b, k, s)
    elif op == "56":
        hand = lambda: ops.matmul_sigmoid_sum(x, w, b)
    else:
        hand = lambda: ops.matmul_avgpool_gelu_scale_max(x, w, b, k, s)
    t0 = ops._small_tail(op, k, s)
    # a copy of the op's tail function: the op's own calls must not find its prepared launches
    tail = types.FunctionType(t0.__code__, t0.__globals__, "tail_copy", t0.__defaults__,
                              t0.__closure__)
    gen = lambda: fused.fused_linear(x, w, b, tail)
    with torch.no_grad():
        d = float((hand().reshape(-1).double() - gen().reshape(-1).double()).abs().max())
    th = time_kb(hand, 20, dev)
    tg = time_kb(gen, 20, dev)
    th2 = time_kb(hand, 20, dev)
    tg2 = time_kb(gen, 20, dev)
    th, tg = min(th, th2), min(tg, tg2)
    print(f"| {op} | {M} | {K} | {N} | {k} | {th:.3f} | {tg:.3f} | {tg / th:.2f} | {d:.2e} |",
          flush=True)
    if "--kernels" in sys.argv:
        for name, fn in (("hand", hand), ("generic", gen)):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            rows: dict = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    rows[e.name] = rows.get(e.name, 0.0) + e.device_time / 5
            print(f"    {name}: " + ", ".join(f"{n[:40]} {t:.0f}us" for n, t in
                                          sorted(rows.items(), key=lambda kv: -kv[1])[:6]))
    del w, b, x
    fused.clear_cache() if hasattr(fused, "clear_cache") else None
    torch.cuda.empty_cache()
