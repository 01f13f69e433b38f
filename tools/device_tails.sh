#!/usr/bin/env bash
# One device call: the GPU tests (all, or GPU_TESTS), then bench --model on the 37
# KernelBench level-2 Linear models. Logs under $OUT.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/device.txt
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-240} python -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests} 2>&1 | tee $OUT/gpu_tests.log | tail -30
fi
timeout ${BENCH_TIMEOUT:-300} python -m cupyfuse bench --model $(ls tests/kernelbench/l2_*.py) --seeds ${SEEDS:-0,1} --reps ${REPS:-15} --json $OUT/kb37.json 2>&1 | tee $OUT/kb37.log | tail -45
