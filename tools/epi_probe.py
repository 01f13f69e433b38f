"""Tails inside the GEMM (codegen.Epilogue) on vs off, on KernelBench files, in one run.

    PYTHONPATH=. python tools/epi_probe.py tests/kernelbench/l2_09_*.py ... [--reps 15]

For each model file: ``fused_class(Model)`` at the file's sizes under KernelBench's
timing (train mode, grad mode, parameters requiring grad, L2 flushed before each call,
median of CUDA events), with epilogues (``codegen.EPILOGUES``) on and off, interleaved
three times; the float64 check of both; whether any level ran as an epilogue; and the
cold compile time of the first call (CuPy's disk cache is empty on a fresh machine).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from cupyfuse import codegen, fused, gemm
from cupyfuse.bench_model import _compare, _to, load_model_file, time_kb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    ran: list[int] = []
    real = gemm.linear_epilogue

    def counted(*a, **kw):
        ran.append(1)
        return real(*a, **kw)

    gemm.linear_epilogue = counted
    fused.gemm.linear_epilogue = counted
    rows = []
    for path in args.files:
        mod = load_model_file(path)
        torch.manual_seed(0)
        init = mod.get_init_inputs()
        torch.manual_seed(0)
        ref_model = mod.Model(*init).to(dev)
        torch.manual_seed(0)
        fm = fused.fused_class(mod.Model)(*init).to(dev)
        torch.manual_seed(1)
        inputs = _to(mod.get_inputs(), dev)
        with torch.no_grad():
            m64 = __import__("copy").deepcopy(ref_model).double()
            ref = m64(*_to(inputs, dev, torch.float64))
        res = {}
        for on in (True, False):
            codegen.EPILOGUES = on
            fused.clear_cache()
            ran.clear()
            t0 = time.perf_counter()
            out = fm(*inputs)
            torch.cuda.synchronize()
            res[on] = {"first_s": time.perf_counter() - t0, "epi": bool(ran),
                       "check": _compare(out, ref)["ok"], "ms": []}
        for _ in range(3):
            for on in (True, False):
                codegen.EPILOGUES = on
                fused.clear_cache()
                fm(*inputs)
                res[on]["ms"].append(time_kb(lambda: fm(*inputs), args.reps, dev))
        on, off = (statistics.median(res[k]["ms"]) for k in (True, False))
        name = path.rsplit("/", 1)[-1][:40]
        rows.append(f"{name:40s} epi={res[True]['epi']!s:5s} on {on:7.3f} off {off:7.3f} "
                    f"off/on {off / on:5.3f}  check {res[True]['check']}/{res[False]['check']}  "
                    f"first call {res[True]['first_s']:.2f}s")
        print(rows[-1], flush=True)
        del fm, ref_model, m64
        torch.cuda.empty_cache()
    codegen.EPILOGUES = True
    print("\n".join(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
