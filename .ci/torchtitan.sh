#!/usr/bin/env bash
# tests/test_torchtitan.py against torchtitan 0.3.0 (the optional extra), in a virtual environment of its own
# that sees this environment's packages (torch, meqmuon, pytest): pip's resolver would replace `datasets` here
# (torchtitan pins datasets<4.8), and on a CPU-only torch torchtitan needs triton, which it imports but does not
# declare. So torchtitan goes in --no-deps, with the modules its model, optimizer, checkpoint and config
# code import. Where that fails, the test file's own run in the main suite has skipped, saying why; this says
# so too and fails, so that CI does not pass without it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
venv_dir="${TORCHTITAN_VENV:-$(mktemp -d)/venv}"
"$PY" -m venv --system-site-packages "$venv_dir"
venv="$venv_dir/bin/python"
"$venv" -m pip install --quiet --disable-pip-version-check --no-deps torchtitan==0.3.0
"$venv" -m pip install --quiet --disable-pip-version-check spmd_types==0.2.3 torch_checkpointing tyro einops \
    torchdata tensorboard triton
"$venv" -c 'import torch; assert torch.__version__.startswith("2.13"), torch.__version__' \
    || { echo "torchtitan.sh: torch changed in the venv"; exit 1; }
cd "$root" && "$venv" -m pytest -q tests/test_torchtitan.py
