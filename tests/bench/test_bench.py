"""The benchmark CLI on the CPU path: ``main(["bench", ...])`` in-process.

The GPU is hidden from the benchmark (``bench.gpu_available`` patched) so these tests
take the CPU path on any machine, at size "small", in a few seconds.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import cupyfuse
from cupyfuse.kernelbench import models
from cupyfuse.bench import problems as bench
from cupyfuse.kernelbench import modules as cfnn
from cupyfuse.__main__ import main

ALL = ["55", "56", "98", "39"]


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch):
    monkeypatch.setattr(bench, "gpu_available", lambda: (False, "hidden by the test"))


def _run(capsys, tmp_path, *extra):
    path = tmp_path / "bench.json"
    rc = main(["bench", "--sizes", "small", "--seeds", "0,1", "--json", str(path), *extra])
    cap = capsys.readouterr()
    return rc, json.loads(path.read_text()), cap.out, cap.err


def test_bench_small_all_correct(capsys, tmp_path):
    rc, doc, out, err = _run(capsys, tmp_path)
    assert rc == 0
    res = {r["problem"]: r for r in doc["results"]}
    assert sorted(res) == sorted(ALL)
    for p in ALL:
        r = res[p]
        assert r["size"] == "small"
        assert r["correct"] is True, r
        assert r["error"] is None
        assert 0 <= r["rel_err"] < 1e-5 and 0 <= r["max_abs_err"] < 1e-4
        assert isinstance(r["max_elem_rel_err"], float)
        assert 0 <= r["eager_rel_err"] < 1e-5  # the original's own fp32 error, a baseline
        # 2 seeds x 2 distributions, all passing
        assert len(r["trials"]) == 4 and all(t["allclose"] for t in r["trials"])
        assert {t["dist"] for t in r["trials"]} == set(bench.DISTRIBUTIONS)
        # no GPU: no timings
        assert r["eager_ms"] is None and r["cupyfuse_ms"] is None and r["pct_of_floor"] is None
    assert res["39"]["running_stats_ok"] is True
    assert doc["all_correct"] is True
    meta = doc["meta"]
    assert meta["gpu"] is False and meta["device"] == "cpu"
    for key in ("date", "torch", "cupy", "gemm_engine", "cupyfuse"):
        assert meta[key]
    # the header and the table are on stdout; the progress bar is not
    assert "No GPU found" in out and "timings are skipped" in out
    assert "correct (rel err)" in out and "cupyfuse ms" in out
    for p in ALL:
        line = next(ln for ln in out.splitlines() if ln.startswith(p + " "))
        assert "small" in line and "pass" in line and line.rstrip().endswith("-")
    assert "all correct" in out
    assert "\r" not in out and "building models" not in out
    assert "building models" in err


def test_bench_marks_wrong_op_as_failed(capsys, tmp_path, monkeypatch):
    real = cupyfuse.fused_class(models.MatmulSigmoidSum).forward

    def wrong(*args, **kwargs):
        return real(*args, **kwargs) * 1.001  # ~0.1% off: far outside atol=rtol=1e-4

    monkeypatch.setattr(cupyfuse.fused_class(models.MatmulSigmoidSum), "forward", wrong)
    rc, doc, out, err = _run(capsys, tmp_path)
    assert rc == 1
    res = {r["problem"]: r for r in doc["results"]}
    assert res["56"]["correct"] is False
    assert not any(t["allclose"] for t in res["56"]["trials"])
    assert res["56"]["rel_err"] > 1e-4
    for p in ("55", "98", "39"):
        assert res[p]["correct"] is True
    assert doc["all_correct"] is False
    line = next(ln for ln in out.splitlines() if ln.startswith("56 "))
    assert "FAIL" in line
    assert "SOME CHECKS FAILED" in out


def test_bench_nan_output_fails(capsys, tmp_path, monkeypatch):
    real = cupyfuse.fused_class(models.MatmulAvgPoolGeluScaleMax).forward

    def nan_first(*args, **kwargs):
        out = real(*args, **kwargs).clone()
        out[0] = float("nan")
        return out

    monkeypatch.setattr(cupyfuse.fused_class(models.MatmulAvgPoolGeluScaleMax), "forward", nan_first)
    rc, doc, out, _ = _run(capsys, tmp_path, "--problems", "98")
    assert rc == 1
    (r,) = doc["results"]
    assert r["correct"] is False and r["rel_err"] == "NaN"  # plain JSON, NaN kept visible
    assert all(t["nonfinite"] == 1 for t in r["trials"])


def test_bench_39_running_stats_checked(capsys, tmp_path, monkeypatch):
    real = cupyfuse.fused_class(models.GemmScaleBatchNorm).forward

    def no_stats(self, x):  # right output, running statistics never updated
        saved = [self.bn.running_mean.clone(), self.bn.running_var.clone()]
        out = real(self, x)
        with torch.no_grad():
            self.bn.running_mean.copy_(saved[0])
            self.bn.running_var.copy_(saved[1])
        return out

    monkeypatch.setattr(cupyfuse.fused_class(models.GemmScaleBatchNorm), "forward", no_stats)
    rc, doc, _, _ = _run(capsys, tmp_path, "--problems", "39")
    assert rc == 1
    (r,) = doc["results"]
    assert r["correct"] is False and r["running_stats_ok"] is False
    assert r["rel_err"] < 1e-5  # the output itself is still right


def test_bench_error_in_case_is_reported(capsys, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(cupyfuse.fused_class(models.MatmulMaxPoolSumScale), "forward", boom)
    rc, doc, out, err = _run(capsys, tmp_path, "--problems", "55,56")
    assert rc == 1
    res = {r["problem"]: r for r in doc["results"]}
    assert res["55"]["correct"] is False and "kernel exploded" in res["55"]["error"]
    assert res["56"]["correct"] is True  # the next problem still ran
    assert "ERROR" in out and "kernel exploded" in err


def test_explicit_sizes_without_gpu_note(capsys, tmp_path):
    rc, doc, out, err = _run(capsys, tmp_path, "--problems", "39", "--sizes", "seed,small")
    assert rc == 0
    assert [r["size"] for r in doc["results"]] == ["small"]
    assert "skipped" in err and "seed" in err


def test_select_cases_skips_missing_sizes():
    notes = []
    cases = bench.select_cases(["55", "39"], ["kernelbench", "seed"], True, notes.append)
    assert cases == [("55", "kernelbench"), ("39", "kernelbench"), ("39", "seed")]
    assert len(notes) == 1 and "55/seed" in notes[0]
    notes.clear()
    bench.select_cases(["55", "39"], ["kernelbench", "seed"], False, notes.append)
    assert notes == []  # defaults skip silently


def test_bad_arguments_exit_2(capsys):
    for argv in (["bench", "--problems", "57"], ["bench", "--sizes", "huge"],
                 ["bench", "--seeds", "a"], ["bench", "--reps", "0"], []):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    capsys.readouterr()


def test_plot_without_timings_is_skipped(capsys, tmp_path):
    png = tmp_path / "plot.png"
    rc, _, _, err = _run(capsys, tmp_path, "--problems", "56", "--plot", str(png))
    assert rc == 0 and not png.exists()
    assert "no timings to plot" in err


def test_plot_with_timings(tmp_path):
    pytest.importorskip("matplotlib")
    recs = []
    for p, s in (("55", "kernelbench"), ("39", "seed")):
        r = bench._new_record(p, s)
        r.update(correct=True, eager_ms=5.3, compile_ms=None, cupyfuse_ms=1.4)
        bench._fill_ratios(r)
        recs.append(r)
    png = tmp_path / "p.png"
    assert bench.write_plot(recs, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_info_command(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "gemm_engine" in out and cupyfuse.__version__ in out


def test_progress_tty_erases_itself():
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    s = Tty()
    p = bench.Progress(3, stream=s)
    p.step("one")
    p.message("hello")
    p.step("two")
    p.close()
    text = s.getvalue()
    assert "hello\n" in text
    # whatever the bar drew, the last thing written blanks the line and returns to column 0
    assert text.endswith("\r") and text.rstrip("\r ").endswith("two")


# --- bench --model on the CPU: files that do not fit the machine are skipped, with figures

_KB = Path(__file__).resolve().parents[1] / "corpus" / "kernelbench_l2"


def test_model_footprint_measured_on_meta():
    """The estimate counts parameters, inputs and output at the file's own sizes (56: a
    32768 x 32768 weight alone is 4 GiB in fp32), without allocating them."""
    from cupyfuse.bench.model import _CPU_COPIES, footprint_gb, load_model_file

    mod = load_model_file(str(_KB / "l2_56_Matmul_Sigmoid_Sum.py"))
    init = mod.get_init_inputs()
    with torch.device("meta"):
        m = mod.Model(*init)
        x = mod.get_inputs()[0]
    numel = sum(p.numel() for p in m.parameters()) + x.numel() + x.shape[0]
    assert footprint_gb(mod) == pytest.approx(_CPU_COPIES * 4 * numel / 2**30)


def test_model_too_big_for_cpu_is_skipped_not_failed(capsys, tmp_path):
    """Over the budget: skipped with the figures, the exit code 0, the JSON says why;
    a file that fits still runs its check."""
    small = tmp_path / "small.py"
    small.write_text(
        "import torch\nfrom torch import nn\n"
        "class Model(nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.fc = nn.Linear(8, 4)\n"
        "    def forward(self, x):\n        return torch.sigmoid(self.fc(x)).sum(1)\n"
        "def get_inputs():\n    return [torch.randn(3, 8)]\n"
        "def get_init_inputs():\n    return []\n")
    js = tmp_path / "out.json"
    rc = main(["bench", "--model", str(_KB / "l2_56_Matmul_Sigmoid_Sum.py"), str(small),
               "--seeds", "0", "--cpu-max-gb", "1", "--json", str(js)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "skipped: needs ~32 GB" in out and "1 GB allowed (--cpu-max-gb)" in out
    recs = json.loads(js.read_text())["results"]
    assert "skipped" in recs[0] and "kb_ok" not in recs[0]
    assert recs[1]["kb_ok"] is True and recs[1]["f64_ok"] is True


def test_sweep_function_cells_in_a_fresh_interpreter(tmp_path):
    """The function cells call cupyfuse.kernelbench's named ops: the sweep imports them
    itself (cupyfuse's own import does not), so a fresh interpreter's run has timings."""
    import subprocess
    import sys

    js = tmp_path / "s.json"
    code = ("from cupyfuse.bench.sweep import run_sweep; "
            "run_sweep(problems=('56',), batches=(2,), features=(8,), modes=('function_torch',), "
            f"reps=1, allow_cpu=True, json_path={str(js)!r})")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                   cwd=Path(__file__).resolve().parents[2])
    cell = json.loads(js.read_text())["cells"][0]
    assert "error" not in cell and cell["cupyfuse_ms"] > 0, cell


_TRAIN_MODEL = (
    "import torch\nfrom torch import nn\nimport torch.nn.functional as F\n"
    "class Model(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__(); self.fc = nn.Linear(12, 20); self.bn = nn.BatchNorm1d(20)\n"
    "    def forward(self, x):\n"
    "        return torch.logsumexp(F.gelu(self.bn(self.fc(x))), 1), self.fc(x).argmax(1)\n"
    "def get_inputs():\n    return [torch.randn(6, 12)]\n"
    "def get_init_inputs():\n    return []\n")


def test_model_train_checks_gradients_on_cpu(capsys, tmp_path):
    """--train on the CPU: every gradient (x, the Linear, BatchNorm's affine) against a
    float64 copy's, a table of its own, the exit code 0; an int64 output is left out."""
    f = tmp_path / "m.py"
    f.write_text(_TRAIN_MODEL)
    js = tmp_path / "out.json"
    rc = main(["bench", "--model", str(f), "--seeds", "0", "--train", "--json", str(js)])
    out = capsys.readouterr().out
    rec = json.loads(js.read_text())["results"][0]
    assert rc == 0 and rec["grad_ok"] is True, out
    why = "recompute (BACKWARD_PROGRAM='none'; backward program: has one)"
    assert f"| m | pass | {why} | — |" in out and "gradients vs float64" in out
    assert rec["backward"] == why


def test_model_train_flags_wrong_gradients(capsys, tmp_path, monkeypatch):
    """Backward products off by 1e-3 (a shift: BatchNorm would undo a scale of the recomputed
    forward): the gradient check fails and the exit code says so (the fused forward does
    not use them: its check passes)."""
    from cupyfuse.backend import gemm

    real = gemm.matmul_nt
    monkeypatch.setattr(gemm, "matmul_nt", lambda a, b, **kw: real(a, b, **kw) + 1e-3)
    f = tmp_path / "m.py"
    f.write_text(_TRAIN_MODEL)
    js = tmp_path / "out.json"
    rc = main(["bench", "--model", str(f), "--seeds", "0", "--train", "--json", str(js)])
    rec = json.loads(js.read_text())["results"][0]
    assert rc == 1 and rec["kb_ok"] is True and rec["grad_ok"] is False
    assert "| m | FAIL |" in capsys.readouterr().out
