"""Small-batch GPU time of skinny launches under other K-split and fused-tail settings:
engine.SKINNY_MIN_KSPAN (the shortest K range per block: more blocks at small K) and
prepared.FUSE_MAX_ROWS_PER_BLOCK (its rule when this probe was first run, 2026-11-26:
the most rows a tail block of the skinny launch took before the tail got a launch of its
own; now: the largest batch whose rows may share tail blocks). Models: the features probe's (seq 16) and the sweep's 56,
55 and "gen" at 1024 features, as modules under no_grad, batches 1, 8, 64; the sweep's
pair timer (interleaved with eager, L2 flushed, CUDA events, median). Each setting after
cupyfuse.clear_cache() with freshly fused modules; each output checked against eager.
``--set`` gives other settings, each a comma list of NAME=VALUE of engine's or prepared's
constants (e.g. ``--set SKINNY_ROW_TILES=3 SKINNY_ROW_TILES=16,SKINNY_TILE_ROWS=4``).
Usage: PYTHONPATH=.:tools python tools/skinny_small_probe.py [--reps 30] [--set ...]"""
import argparse

import torch

import cupyfuse
from cupyfuse import bench_sweep, engine, prepared
from features_probe import MODELS

SETTINGS = ["SKINNY_MIN_KSPAN=512,FUSE_MAX_ROWS_PER_BLOCK=4",
            "SKINNY_MIN_KSPAN=256,FUSE_MAX_ROWS_PER_BLOCK=4",
            "SKINNY_MIN_KSPAN=128,FUSE_MAX_ROWS_PER_BLOCK=4",
            "SKINNY_MIN_KSPAN=512,FUSE_MAX_ROWS_PER_BLOCK=1",
            "SKINNY_MIN_KSPAN=128,FUSE_MAX_ROWS_PER_BLOCK=1"]


def _apply(setting: str) -> None:
    for item in setting.split(","):
        name, value = item.split("=")
        mod = engine if hasattr(engine, name) else prepared
        if not hasattr(mod, name):
            raise SystemExit(f"no constant {name} in engine or prepared")
        setattr(mod, name, int(value))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 8, 64])
    ap.add_argument("--set", nargs="*", default=SETTINGS)
    args = ap.parse_args()
    dev = torch.device("cuda")
    pair = bench_sweep._timer(dev)
    cases = []
    for name, (cls, seq) in MODELS.items():
        torch.manual_seed(0)
        cases.append((name, cls().to(dev).eval(), cls, seq, 512))
    for prob in ("56", "55", "gen"):
        torch.manual_seed(0)
        m = bench_sweep._model(prob, 1024, dev).eval()
        cases.append((prob, m, None, False, 1024))
    res = {}
    defaults = {n: getattr(engine if hasattr(engine, n) else prepared, n)
                for st in args.set for n in (i.split("=")[0] for i in st.split(","))}
    for setting in args.set:
        _apply(",".join(f"{n}={v}" for n, v in defaults.items()))
        _apply(setting)
        cupyfuse.clear_cache()
        for name, orig, cls, seq, f in cases:
            if cls is not None:
                fm = cupyfuse.fused_class(cls)().to(dev)
                fm.load_state_dict(orig.state_dict())
                fm.eval()
            else:
                fm = cupyfuse.from_model(orig)
            for b in args.batches:
                x = torch.randn((b, 16, f) if seq else (b, f), device=dev)
                with torch.no_grad():
                    diff = (orig(x) - fm(x)).abs().max().item()
                    te, tf = pair(lambda: orig(x), lambda: fm(x), args.reps)
                res.setdefault((name, b), {})[setting] = (te, tf, diff)
    for j, st in enumerate(args.set):
        print(f"setting {j}: {st}")
    head = " | ".join(f"setting {j}" for j in range(len(args.set)))
    print(f"| model | batch | eager ms | {head} | max diff |")
    print("|---|---|---|" + "---|" * len(args.set) + "---|")
    for (name, b), d in res.items():
        te = min(v[0] for v in d.values())
        cells = " | ".join(f"{d[s][1]:.4f} ({d[s][0] / d[s][1]:.2f}x)" for s in args.set)
        print(f"| {name} | {b} | {te:.4f} | {cells} | {max(v[2] for v in d.values()):.1e} |")


if __name__ == "__main__":
    main()
