#!/usr/bin/env bash
# The GPU suite in two device calls (one call's 10 minutes do not hold it all):
#   HALF=a bash tools/device_halves.sh   # the engine, ops, fuzz and state tests
#   HALF=b bash tools/device_halves.sh   # every other gpu-marked test (SKIP="f ...": not these)
# Logs under $OUT (gpu_a.log / gpu_b.log); the summary line printed.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
A="tests/test_fuzz_gpu.py tests/test_globals_gpu.py tests/test_gpu_engine.py tests/test_gpu_ops.py
   tests/test_gpu_skinny.py tests/test_model_state.py tests/test_derived_weights.py
   tests/test_several_outputs.py tests/test_gpu_prepared.py"
if [ "${HALF:-a}" = a ]; then
  SEL="$A"
else
  SEL="tests $(for f in $A ${SKIP:-}; do printf -- '--ignore=%s ' "$f"; done)"
fi
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${TEST_TIMEOUT:-540} python -m pytest -q -m gpu -p no:cacheprovider $SEL \
  > "$OUT/gpu_${HALF:-a}.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_${HALF:-a}.log" | tail -15
