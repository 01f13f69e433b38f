#!/usr/bin/env bash
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 tools/profile_host.py > "$OUT/profile_host.txt" 2>&1; head -45 "$OUT/profile_host.txt" | tail -32
python3 tools/overhead.py 2>&1 | tee "$OUT/overhead.txt"
python3 tools/gemm_probe.py 2>&1 | tee "$OUT/gemm_probe.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider -ra tests/ > "$OUT/gpu_tests.txt" 2>&1
tail -12 "$OUT/gpu_tests.txt"
