"""The notebooks in notebooks/: valid nbformat 4, saved outputs clean, and they run on the CPU.

(a) each notebook is nbformat 4 JSON with at least one code cell (checked with nbformat too
    when it is installed);
(b) the outputs saved in each file hold no "error" output and at least one "image/png";
(c) tools/run_notebooks.py (without --write: the files are left alone) runs them all, top to
    bottom, in one subprocess on this machine, within 300 s.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
RUNNER = ROOT / "tools" / "run_notebooks.py"
OUTPUT_TYPES = {"stream", "display_data", "execute_result", "error"}


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _text(src) -> str:
    return "".join(src) if isinstance(src, list) else src


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert {"01_quickstart.ipynb", "02_where_the_time_goes.ipynb",
            "03_write_your_own_tail.ipynb"} <= set(names), names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_nbformat4(path: Path):
    nb = _load(path)
    assert nb["nbformat"] == 4 and isinstance(nb.get("nbformat_minor"), int)
    assert isinstance(nb.get("metadata"), dict)
    cells = nb["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code, "no code cell"
    ids = [c.get("id") for c in cells]
    if nb["nbformat_minor"] >= 5:
        assert all(ids) and len(set(ids)) == len(ids), "cell ids missing or repeated"
    for c in cells:
        assert c["cell_type"] in ("code", "markdown", "raw")
        assert isinstance(c["metadata"], dict)
        assert isinstance(_text(c["source"]), str)
        if c["cell_type"] != "code":
            assert "outputs" not in c
            continue
        assert c["execution_count"] is None or isinstance(c["execution_count"], int)
        for o in c["outputs"]:
            assert o["output_type"] in OUTPUT_TYPES, o["output_type"]
            if o["output_type"] == "stream":
                assert o["name"] in ("stdout", "stderr") and isinstance(_text(o["text"]), str)
            elif o["output_type"] == "error":
                assert {"ename", "evalue", "traceback"} <= set(o)
            else:
                assert isinstance(o["data"], dict) and isinstance(o["metadata"], dict)
    try:
        import nbformat
    except ImportError:
        return
    nbformat.validate(nbformat.reads(path.read_text(encoding="utf-8"), as_version=4))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_saved_outputs_have_a_plot_and_no_error(path: Path):
    nb = _load(path)
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    errors = [o for o in outputs if o["output_type"] == "error"]
    assert not errors, f"saved error: {errors[0]['ename']}: {errors[0]['evalue']}"
    pngs = [o["data"]["image/png"] for o in outputs
            if o["output_type"] in ("display_data", "execute_result") and "image/png" in o["data"]]
    assert pngs, "no image/png output saved: run tools/run_notebooks.py notebooks/*.ipynb --write"
    for png in pngs:
        assert base64.b64decode(_text(png))[:8] == b"\x89PNG\r\n\x1a\n"
    # every code cell ran, in order (the runner numbers them 1, 2, ...)
    counts = [c["execution_count"] for c in nb["cells"] if c["cell_type"] == "code"]
    assert counts == list(range(1, len(counts) + 1)), counts


def test_notebooks_run_on_this_machine():
    """tools/run_notebooks.py without --write: every cell of every notebook runs."""
    before = {p: p.read_bytes() for p in NOTEBOOKS}
    env = dict(os.environ, MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(RUNNER), *map(str, NOTEBOOKS)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for p in NOTEBOOKS:
        assert f"[{p.name}] ran in" in proc.stderr
        assert p.read_bytes() == before[p], f"{p.name} was modified without --write"


def test_runner_records_outputs_and_stops_at_an_error(tmp_path: Path):
    """The runner itself, on a small notebook: streams, results, figures, an error, --write."""
    def code(src: str) -> dict:
        return {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                "source": src}

    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": "# t"},
                    code("import sys, os\nprint('hi')\nprint('warn', file=sys.stderr)\nos.getcwd()"),
                    code("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nx = 1;"),
                    code("1 / 0"),
                    code("print('never')")],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 4}
    path = tmp_path / "t.ipynb"
    path.write_text(json.dumps(nb))
    proc = subprocess.run([sys.executable, str(RUNNER), str(path), "--write"], cwd=tmp_path,
                          env=dict(os.environ, MPLBACKEND="Agg"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    out = _load(path)
    c1, c2, c3, c4 = [c for c in out["cells"] if c["cell_type"] == "code"]
    assert [o["output_type"] for o in c1["outputs"]] == ["stream", "stream", "execute_result"]
    assert _text(c1["outputs"][0]["text"]) == "hi\n" and c1["outputs"][1]["name"] == "stderr"
    assert _text(c1["outputs"][2]["data"]["text/plain"]) == repr(str(ROOT))  # runs from the root
    assert [o["output_type"] for o in c2["outputs"]] == ["display_data"]  # `x = 1;`: no result
    assert "image/png" in c2["outputs"][0]["data"]
    err = c3["outputs"][-1]
    assert err["output_type"] == "error" and err["ename"] == "ZeroDivisionError"
    assert any("1 / 0" in line for line in err["traceback"])
    assert (c3["execution_count"], c4["execution_count"], c4["outputs"]) == (3, None, [])
    assert out["nbformat_minor"] == 5 and all(c.get("id") for c in out["cells"])
