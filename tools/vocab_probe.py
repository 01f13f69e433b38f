"""Seeded random tails that force a unary op (the generator's unary kinds, the new math
ops among them) on the current device against float64: one line per failing seed, then
a count. PYTHONPATH=.:tests python tools/vocab_probe.py [n_seeds]"""
import collections
import sys
import warnings

from _tailgen import run_case, seeded_case

warnings.simplefilter("ignore")
n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
seen: collections.Counter = collections.Counter()
bad = 0
for s in range(n):
    c = seeded_case(s, allow=("unary", "const", "reduce"), force=("unary",))
    text = str(c.spec.__dict__)
    for k in ("atan2", "atan(", "sinh", "cosh", "asinh", "hypot", "logaddexp", "fmod"):
        seen[k] += k in text
    try:
        run_case(c, "cuda")
    except Exception as exc:  # noqa: BLE001 - report and go on
        bad += 1
        print(f"seed {s}: {str(exc)[:300]}", flush=True)
print(f"{n} seeds, {bad} failed; new ops drawn: {dict(seen)}")
