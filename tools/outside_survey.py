"""Survey of the outside-written corpus (tests/corpus/outside/): every model in every mode through
``cupyfuse.from_model`` (``--api fused_class`` or ``both`` for the drop-in class), against
the float64 eager model at atol = rtol = 1e-4.

    PYTHONPATH=. python tools/outside_survey.py [--api from_model|fused_class|both]
        [--only NAME,...] [--nonfinite] [--markdown]

Prints one row per model and mode (outcome, max scaled error |out - ref| / (atol + rtol
|ref|), where <= 1 passes; the refusal's first line), the totals per model, the refusal
categories (most common first) and the expectations recorded in the corpus that the run
contradicts.
"""
from __future__ import annotations

import argparse
import re
import sys
import warnings
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from corpus.outside import CONVERTS, REFUSED, all_cases  # noqa: E402
from corpus.outside.harness import refusal_problem, run_case, run_nonfinite  # noqa: E402

_STATUS_TO_EXPECT = {"match": CONVERTS, "refused": REFUSED}


def category(msg: str) -> tuple[str, str]:
    """(category, op) of a refusal: its first line without the model's name, the op, other
    names in backticks, shapes and numbers, so refusals of one kind fall in one group."""
    line = msg.strip().splitlines()[0] if msg.strip() else "(empty message)"
    line = re.sub(r"^\w+: ", "", line)                      # "ModelName: " / "ModelNameFused: "
    m = re.match(r"cannot fuse `([^`]*)`: (.*)", line)
    if m:
        prefix, (op, rest) = "cannot fuse `op`: ", m.groups()
    else:
        m = re.match(r"([\w.]+): (.*)", line)
        prefix, (op, rest) = ("`op`: ", m.groups()) if m else ("", ("", line))
    rest = re.sub(r"`[^`]*`", "`…`", rest)
    rest = re.sub(r"\(TraceError: ([^.;(]*)[^)]*\)", r"(TraceError: \1)", rest)
    rest = re.sub(r"\(batch(, \w+)+\)", "(batch, ...)", rest)
    rest = re.sub(r"\b\d+(\.\d+)?\b", "N", rest)
    rest = re.sub(r"\s+", " ", rest).strip(" :,")
    return (prefix + rest)[:140], op


def _by_module(cases: list) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    for c in cases:
        out[c.module].append(c)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--api", default="from_model", choices=("from_model", "fused_class", "both"))
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--nonfinite", action="store_true", help="also the NaN/inf input check")
    ap.add_argument("--width", type=int, default=110, help="width of the refusal column")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    apis = ("from_model", "fused_class") if args.api == "both" else (args.api,)
    only = {s for s in args.only.split(",") if s}
    cases = [c for c in all_cases() if not only or c.name in only]

    rows = []
    per_model: dict[str, list[str]] = defaultdict(list)
    refusals: list[tuple[str, str]] = []
    surprises = []
    known = []
    print(f"{'model':34} {'module':12} {'mode':5} {'api':11} {'outcome':9} {'max err':>9}  refusal / problem")
    for c in cases:
        for mode in c.modes:
            for api in apis:
                o = run_case(c, mode, api)
                rows.append((c, mode, api, o))
                per_model[c.name].append(o.status)
                msg = o.first_line if o.status != "match" else ""
                if o.status == "refused" and refusal_problem(o.message):
                    msg = f"[{refusal_problem(o.message)}] {msg}"
                err = f"{o.err:9.3g}" if o.status in ("match", "mismatch") else " " * 9
                print(f"{c.name:34} {c.module:12} {mode:5} {api:11} {o.status:9} {err}  "
                      f"{msg[:args.width]}")
                if o.status == "refused":
                    refusals.append((c.name, o.message))
                exp = c.expected(mode)
                got = _STATUS_TO_EXPECT.get(o.status, o.status)
                if c.xfail_reason(mode):
                    known.append((c.name, mode, api, o.status, c.xfail_reason(mode)))
                elif exp != got:
                    surprises.append((c.name, mode, api, exp, got, o.first_line))
            if args.nonfinite and c.modes[0] == mode and not c.xfail_reason(mode) and \
                    "cpu" in c.nonfinite_devices:
                o = run_nonfinite(c)
                if o.status not in ("match", "refused"):
                    print(f"{'':34} {'':12} {'nan':5} {'from_model':11} {o.status:9} "
                          f"{'':9}  {o.first_line[:args.width]}")
                    surprises.append((c.name, "nonfinite", "from_model", "match", o.status,
                                      o.first_line))

    def verdict(statuses: list[str]) -> str:
        if "mismatch" in statuses:
            return "wrong answer"
        if "error" in statuses:
            return "error"
        if all(s == "match" for s in statuses):
            return "converted"
        if all(s == "refused" for s in statuses):
            return "refused"
        return "converted in some modes"

    in_scope = [c for c in cases if c.module != "out_of_scope"]
    oos = [c for c in cases if c.module == "out_of_scope"]
    print()
    print(f"models: {len(cases)} ({len(in_scope)} of the kind, {len(oos)} out of scope); "
          f"model x mode x api runs: {len(rows)}")
    for label, group in (("of the kind", in_scope), ("out of scope", oos)):
        cnt = Counter(verdict(per_model[c.name]) for c in group)
        print(f"  {label:13}: " + ", ".join(f"{k} {v}" for k, v in cnt.most_common()))
    run_cnt = Counter(o.status for *_, o in rows)
    print("  runs         : " + ", ".join(f"{k} {v}" for k, v in run_cnt.most_common()))
    print("  per module   : " + "; ".join(
        f"{mod} {sum(verdict(per_model[c.name]) == 'converted' for c in group)}/{len(group)}"
        for mod, group in sorted(_by_module(cases).items())) + " converted in every mode")

    print("\nrefusal categories (models, most common first):")
    cats: dict[str, dict[str, str]] = defaultdict(dict)
    for name, msg in refusals:
        cat, op = category(msg)
        cats[cat][name] = op
    for cat, names in sorted(cats.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        print(f"  {len(names):3}  {cat}")
        items = [f"{n} ({op})" if op else n for n, op in sorted(names.items())]
        print("       " + ", ".join(items))

    bad = [r for r in rows if r[3].status in ("mismatch", "error")]
    if bad:
        print("\nwrong answers and errors:")
        for c, mode, api, o in bad:
            print(f"  {c.name} ({mode}, {api}) {o.status}: " + o.message.replace("\n", "\n      "))
    if known:
        print("\nknown problems (strict xfails in the corpus):")
        for name, mode, api, status, reason in known:
            print(f"  {name} ({mode}, {api}): {status}; {reason[:args.width]}")
    if surprises:
        print("\noutcomes that differ from the corpus's expectations:")
        for name, mode, api, exp, got, line in surprises:
            print(f"  {name} ({mode}, {api}): expected {exp}, got {got}  {line[:args.width]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
