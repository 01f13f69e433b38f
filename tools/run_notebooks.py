#!/usr/bin/env python3
"""Run Jupyter notebooks top to bottom without Jupyter, and optionally save their outputs.

    python tools/run_notebooks.py notebooks/*.ipynb [--write]

A small stand-in for nbclient (the GPU machine has no Jupyter, nbformat, nbclient or
ipykernel): each notebook's code cells run in order with ``exec`` in one fresh namespace,
from the repository root (the working directory, also put first on ``sys.path``). For
each cell it records, as nbformat 4 outputs:

* stdout / stderr text (``stream`` outputs, in the order written);
* the value of the cell's last expression, unless None or the cell ends with ``;``
  (``execute_result``, ``text/plain`` = its repr);
* every matplotlib figure open after the cell (Agg backend; ``display_data`` with
  ``image/png``, base64), which are then closed;
* an exception (``error`` with ename/evalue/traceback): that notebook stops there, the
  rest of its cells get no outputs, and the runner exits 1 after the other notebooks.

Without ``--write`` it only checks that the notebooks run (files untouched); with
``--write`` it saves ``execution_count`` and ``outputs`` into each file (valid nbformat 4
JSON; checked with nbformat when that is installed). Progress lines go to stderr.
"""
from __future__ import annotations

import argparse
import ast
import base64
import gc
import io
import json
import linecache
import os
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PNG_DPI = 80


# ---------------------------------------------------------------------------------
# output capture
class _Capture(io.TextIOBase):
    """A text stream that appends what is written to a list of nbformat stream outputs."""

    def __init__(self, name: str, outputs: list[dict[str, Any]]) -> None:
        self.name = name
        self.outputs = outputs

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not s:
            return 0
        last = self.outputs[-1] if self.outputs else None
        if last is not None and last["output_type"] == "stream" and last["name"] == self.name:
            last["text"] += s
        else:
            self.outputs.append({"output_type": "stream", "name": self.name, "text": s})
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _lines(text: str) -> list[str]:
    """nbformat's multiline-string form: a list of lines, each keeping its newline."""
    return text.splitlines(True)


def _figures(execution_count: int) -> list[dict[str, Any]]:
    """PNG display_data outputs of every open matplotlib figure; closes them."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    outs = []
    for num in plt.get_fignums():
        fig = plt.figure(num)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=PNG_DPI, bbox_inches="tight")
        w, h = fig.get_size_inches() * fig.dpi
        outs.append({
            "output_type": "display_data",
            "data": {"image/png": base64.b64encode(buf.getvalue()).decode("ascii") + "\n",
                     "text/plain": [f"<Figure size {w:g}x{h:g} with {len(fig.axes)} Axes>"]},
            "metadata": {},
        })
    plt.close("all")
    return outs


def _source(cell: dict[str, Any]) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _run_cell(src: str, ns: dict[str, Any], filename: str, outputs: list[dict[str, Any]],
              count: int) -> BaseException | None:
    """Execute one cell's source in ``ns``; append its outputs; return its exception."""
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    out, err = _Capture("stdout", outputs), _Capture("stderr", outputs)
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        tree = ast.parse(src, filename=filename, mode="exec")
        last_expr = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not src.rstrip().endswith(";"):
            last_expr = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), ns)
        if last_expr is not None:
            value = eval(compile(last_expr, filename, "eval"), ns)
            if value is not None:
                ns["_"] = value
                outputs.append({"output_type": "execute_result", "execution_count": count,
                                "data": {"text/plain": _lines(repr(value))}, "metadata": {}})
        return None
    except BaseException as exc:  # noqa: BLE001 - a cell may raise anything, SystemExit too
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = exc.__traceback__
        # drop this runner's own frames: the traceback starts in the cell
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        lines = traceback.format_exception(type(exc), exc, tb)
        outputs.append({"output_type": "error", "ename": type(exc).__name__,
                        "evalue": str(exc), "traceback": [ln.rstrip("\n") for ln in lines]})
        return exc
    finally:
        sys.stdout, sys.stderr = old
        for o in outputs:
            if o["output_type"] == "stream" and isinstance(o["text"], str):
                o["text"] = _lines(o["text"])


def run_notebook(path: Path, write: bool) -> bool:
    """Run one notebook; True when every code cell ran. Writes outputs back if ``write``."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    if nb.get("nbformat") != 4:
        raise SystemExit(f"{path}: not an nbformat 4 notebook")
    ns: dict[str, Any] = {"__name__": "__main__", "__file__": str(path.resolve()),
                          "__builtins__": __builtins__}
    cells = nb.get("cells", [])
    code_cells = [c for c in cells if c.get("cell_type") == "code"]
    count, failed = 0, False
    t_nb = time.perf_counter()
    for cell in cells:
        if cell.get("cell_type") != "code":
            continue
        cell["outputs"], cell["execution_count"] = [], None
        if failed:
            continue
        count += 1
        src = _source(cell)
        t0 = time.perf_counter()
        exc = _run_cell(src, ns, f"<{path.stem} cell {count}>", cell["outputs"], count)
        cell["outputs"] += _figures(count)
        cell["execution_count"] = count
        dt = time.perf_counter() - t0
        state = "ok" if exc is None else f"FAILED: {type(exc).__name__}: {exc}".splitlines()[0]
        print(f"[{path.name}] cell {count}/{len(code_cells)} {state} ({dt:.1f} s)",
              file=sys.stderr, flush=True)
        if exc is not None:
            for o in cell["outputs"]:
                if o["output_type"] == "error":
                    print("\n".join(o["traceback"]), file=sys.stderr, flush=True)
            failed = True
    for cell in cells:  # nbformat 4.5 wants a unique id on every cell
        cell.setdefault("id", uuid.uuid4().hex[:8])
        cell.setdefault("metadata", {})
    nb["nbformat_minor"] = max(int(nb.get("nbformat_minor", 0)), 5)
    _validate(nb, path)
    print(f"[{path.name}] {'ran' if not failed else 'STOPPED at an error'} in "
          f"{time.perf_counter() - t_nb:.1f} s", file=sys.stderr, flush=True)
    if write:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    ns.clear()
    gc.collect()
    return not failed


def _validate(nb: dict[str, Any], path: Path) -> None:
    try:
        import nbformat
    except ImportError:
        return
    nbformat.validate(nbformat.from_dict(nb))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="+", help=".ipynb files")
    ap.add_argument("--write", action="store_true", help="save the outputs into the files")
    args = ap.parse_args(argv)
    paths = [Path(p).resolve() for p in args.notebooks]
    os.chdir(ROOT)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ["MPLBACKEND"] = "Agg"
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        pass
    ok = True
    for p in paths:
        ok = run_notebook(p, args.write) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
