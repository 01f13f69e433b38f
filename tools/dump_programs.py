"""Dump the program, plan and generated kernels of every corpus model (KernelBench and
tests/outside), one text file per model and mode, for comparing two trees.

    PYTHONPATH=. python tools/dump_programs.py OUTDIR
    diff -r OUTDIR_BEFORE OUTDIR_AFTER

A restructuring of the front end, the IR or the code generator should leave every dump
identical (or explain each difference). KernelBench models are built on the meta device
at their own sizes (nothing is allocated); outside models at their small CPU sizes.
"""
from __future__ import annotations

import hashlib
import sys
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cupyfuse  # noqa: E402
from cupyfuse import TailError  # noqa: E402


def _describe(fm: torch.nn.Module, inputs: tuple) -> str:
    from cupyfuse.backend import codegen

    from cupyfuse.api import program

    prog = program(fm, *inputs)
    parts = [prog.describe()]
    for label, p in (("rewritten", prog), ("unrewritten", getattr(prog, "unrewritten", None))):
        if p is None or (label == "unrewritten" and p is prog):
            continue
        pl = codegen.compile_program(p)
        parts.append(f"-- plan ({label})\n" + pl.describe())
        for lv in pl.levels:
            if lv.kernel:
                parts.append(f"-- level {lv.index} kernel {lv.name} sha1 "
                             + hashlib.sha1(lv.kernel.encode()).hexdigest())
            epi = getattr(lv, "epi", None)
            if epi is not None:
                parts.append(f"-- level {lv.index} epilogue {epi.name} sha1 "
                             + hashlib.sha1(epi.kernel.encode()).hexdigest())
    return "\n".join(parts) + "\n"


def _one(make_model, inputs: tuple, mode: str) -> str:
    try:
        model = make_model()
        model.train(mode == "train")
        fm = cupyfuse.from_model(model)
        return _describe(fm, inputs)
    except TailError as e:
        return "refused: " + str(e).splitlines()[0] + "\n"
    except Exception as e:  # noqa: BLE001 - a crash is part of the dump
        return "error: " + "".join(traceback.format_exception_only(type(e), e)).strip() + "\n"


def kernelbench(out: Path) -> None:
    from tests.corpus.kernelbench_l2.index import PROBLEMS, load

    for num, fname in PROBLEMS:
        mod = load(fname)
        with torch.device("meta"):
            init = mod.get_init_inputs()
            inputs = tuple(mod.get_inputs())
        for mode in ("train", "eval"):
            def make(mod=mod, init=init):
                torch.manual_seed(0)
                with torch.device("meta"):
                    return mod.Model(*init)
            (out / f"kb{num:02d}_{mode}.txt").write_text(_one(make, inputs, mode))


def outside(out: Path) -> None:
    from tests.corpus.outside import all_cases

    for case in all_cases():
        for mode in case.modes:
            for batch in case.batches[:1]:
                torch.manual_seed(0)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        model, inputs = case.make(cls=case.cls, batch=batch)
                except Exception as e:  # noqa: BLE001
                    (out / f"out_{case.name}_{mode}.txt").write_text(f"make failed: {e}\n")
                    continue
                text = _one(lambda model=model: model, tuple(inputs), mode)
                (out / f"out_{case.name}_{mode}.txt").write_text(text)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    warnings.simplefilter("ignore")
    kernelbench(out)
    outside(out)
    n = len(list(out.iterdir()))
    print(f"{n} dumps in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
