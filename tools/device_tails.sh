#!/usr/bin/env bash
# One device call: GPU tests of the generated tails, then bench --model on the 37
# KernelBench level-2 Linear models. Logs under $OUT.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/device.txt
python tools/gpu_smoke_tails.py 2>&1 | tee $OUT/smoke.log
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-240} python -m pytest -q -x -m gpu ${GPU_TESTS:-tests/test_tails_gpu.py} 2>&1 | tail -40 | tee $OUT/gpu_tests.log
fi
timeout ${BENCH_TIMEOUT:-300} python -m cupyfuse bench --model $(ls tests/kernelbench/l2_*.py) --seeds 0,1 --reps ${REPS:-15} --json $OUT/kb37.json 2>&1 | tee $OUT/kb37.log
