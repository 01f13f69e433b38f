#!/usr/bin/env bash
# Run the tests: `bash tools/test.sh [pytest arguments]` (makes ./.venv the first time).
# Without a GPU the GPU tests skip with their reason; HYPOTHESIS_PROFILE=thorough draws ten
# times as many property-test examples as the default (ci) profile.
. "$(dirname "$0")/env.sh"
python - <<'PY'
import torch
import cupyfuse
print(f"cupyfuse {cupyfuse.__version__}, torch {torch.__version__}, "
      f"device: {cupyfuse.info()['device']}")
PY
# the tests in parallel over the machine's cores (pytest-xdist, part of the test extra)
exec python -m pytest -q -n auto "$@"
