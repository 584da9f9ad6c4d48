#!/usr/bin/env bash
# Install meqmuon editable with the given extras (default: train,dev), without ever replacing an
# installed torch: a user's CUDA build stays. Only where no torch is importable is torch==2.13.0
# installed first (the CPU wheel these machines carry locally, found through pip's find-links).
set -euo pipefail
extras="${1:-train,dev}"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
# torch is already satisfied here, so this pulls only the pure-Python extras.
"$PY" -m pip install --quiet -e ".[${extras}]"
"$PY" -c "import torch, meqmuon; print(f'meqmuon {meqmuon.__version__} with torch {torch.__version__}')"
