#!/usr/bin/env bash
# One device call: GPU tests (incl. KernelBench sizes), GEMM bench, model bench. Logs under $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -ra ${TESTS:-tests/} > "$OUT/gpu_tests.txt" 2>&1
grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.txt" | tail -25
[ -n "${SKIP_GEMM:-}" ] || timeout 300 python3 -m cupyfuse gemm-bench --json "$OUT/gemm_bench.json" 2>/dev/null | tee "$OUT/gemm_bench.txt"
[ -n "${SKIP_BENCH:-}" ] || timeout 400 python3 -m cupyfuse bench ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" 2> "$OUT/bench_progress.txt" | tee "$OUT/bench.txt"
# the LM head against its peers; Liger-Kernel where a wheel was carried (LIGER_WHEELS=dir)
if [ -z "${SKIP_LMHEAD:-}" ]; then
  [ -n "${LIGER_WHEELS:-}" ] && pip install -q --no-deps --target /tmp/pk "$LIGER_WHEELS"/*.whl >/dev/null 2>&1 \
    && export PYTHONPATH=.:/tmp/pk
  timeout 300 python3 -m cupyfuse bench --lm-head --reps 10 --json "$OUT/lm_head.json" 2> "$OUT/lm_head_progress.txt" | tee "$OUT/lm_head.txt"
fi
# training steps of the KernelBench models: the recompute (CUDA's default) and the backward
# program (CUPYFUSE_BACKWARD_PROGRAM=all), one after the other on the same machine
if [ -z "${SKIP_TRAIN:-}" ]; then
  timeout 500 python3 -m cupyfuse bench --model tests/corpus/kernelbench_l2/l2_*.py --train --reps 10 \
    --json "$OUT/train_recompute.json" 2> "$OUT/train_progress.txt" | tee "$OUT/train_recompute.txt"
  CUPYFUSE_BACKWARD_PROGRAM=all timeout 500 python3 -m cupyfuse bench --model tests/corpus/kernelbench_l2/l2_*.py \
    --train --reps 10 --json "$OUT/train_program.json" 2>> "$OUT/train_progress.txt" | tee "$OUT/train_program.txt"
fi
