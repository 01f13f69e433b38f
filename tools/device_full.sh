#!/usr/bin/env bash
# One device call: GPU tests (incl. KernelBench sizes), then the bench. Logs under $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider -ra tests/ 2>&1 > "$OUT/gpu_tests.txt"
tail -15 "$OUT/gpu_tests.txt"
python3 tools/overhead.py 2>&1 | tee "$OUT/overhead.txt"
python3 -m cupyfuse bench ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" 2> "$OUT/bench_progress.txt" | tee "$OUT/bench.txt"
