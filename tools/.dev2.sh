export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 500 python3 -m cupyfuse bench --model tests/corpus/kernelbench_l2/l2_*.py --train --reps 10 --json $OUT/train.json > $OUT/train.txt 2> $OUT/train_err.txt
tail -50 $OUT/train.txt; tail -3 $OUT/train_err.txt
