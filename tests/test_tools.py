"""tools/dump_programs.py (the restructuring guard: every corpus model's program, plan and
kernel digests) still finds both corpora and writes a dump per model and mode."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("dump_programs", ROOT / "tools" / "dump_programs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dump_programs_reads_both_corpora(tmp_path, monkeypatch):
    tool = _tool()
    import tests.corpus.kernelbench_l2.index as kb
    import tests.corpus.outside as outside

    monkeypatch.setattr(kb, "PROBLEMS", [p for p in kb.PROBLEMS if p[0] in (56, 98)])
    cases = outside.all_cases()
    assert cases, "the outside corpus is empty"
    monkeypatch.setattr(outside, "all_cases", lambda: cases[:2])
    assert tool.main([str(tmp_path)]) == 0
    kb98 = (tmp_path / "kb98_train.txt").read_text()
    assert "rred.max" in kb98 and "kernel" in kb98, kb98[:300]
    assert len(list(tmp_path.glob("kb*.txt"))) == 4
    outs = list(tmp_path.glob("out_*.txt"))
    assert outs and all(p.read_text().strip() for p in outs)
