#!/usr/bin/env bash
# One device call: environment facts, GPU tests, a first timing. Logs under $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import cupyfuse, json; print(json.dumps(cupyfuse.info(), indent=1))" 2>&1 | tee -a "$OUT/env.txt"
python3 -m pytest -q -x -m "gpu" tests/test_gpu_ops.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -40
