# Sourced by tools/test.sh and tools/bench.sh: make ./.venv (once) by the route this
# machine allows, and activate it.
#   no working GPU: a CPU build of torch, no CuPy (every op runs its CPU path);
#   an NVIDIA GPU:  a CUDA build of torch, then CuPy for torch's CUDA major (cupy-cuda12x
#                   or cupy-cuda13x, the project's extras cuda12 / cuda13).
# CUPYFUSE_VENV names another place for the environment.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CUPYFUSE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "cupyfuse: making $VENV" >&2
  "$PY" -m venv "$VENV"
  . "$VENV/bin/activate"
  python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "cupyfuse: GPU found: torch (CUDA build) and CuPy for its CUDA major" >&2
    python -m pip install -q torch
    major=$(python -c "import torch; print((torch.version.cuda or '12').split('.')[0])")
    python -m pip install -q -e "$ROOT[cuda$major,test]"
  else
    echo "cupyfuse: no GPU: a CPU build of torch, no CuPy (the CPU path runs)" >&2
    # a CPU wheel kept on the machine first (torch==2.13.0 resolves to it where it
    # exists), else PyTorch's CPU index (plain PyPI torch is a CUDA build of several GB)
    python -m pip install -q torch==2.13.0 2>/dev/null \
      || python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
    python -m pip install -q -e "$ROOT[test]"
  fi
else
  . "$VENV/bin/activate"
fi
cd "$ROOT"
