#!/usr/bin/env bash
# Run the benchmark: `bash tools/bench.sh [bench arguments]` (makes ./.venv the first
# time). With a GPU: the four seed models checked and timed against PyTorch eager and
# torch.compile (`--model FILE...`, `--sweep`: see `python -m cupyfuse bench --help`);
# without one, the CPU path is checked at sizes that fit the machine.
. "$(dirname "$0")/env.sh"
exec python -m cupyfuse bench "$@"
