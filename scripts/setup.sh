#!/usr/bin/env bash
# Creates .venv (if missing) and installs verl_async for CPU: the CPU torch build
# first, so that no CUDA wheels are pulled, then the package with its test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[test]"
echo "verl_async installed in $(pwd)/.venv"
