#!/usr/bin/env bash
# Wheels the device image lacks beyond /work/shared/device/make_device_wheels.sh's set, into .whl/ (Python 3.12,
# x86_64): pydantic and its deps, versions matched by pip (verl_async.tools' schemas; ray[default] would bring them, the carried Ray is stripped);
# peft + accelerate + psutil (LoRA: actor_rollout_ref.model.lora_rank > 0, scripts/bench_lora.py), pure Python, no deps pulled.
#   bash scripts/device/extra_wheels.sh      # here, after make_device_wheels.sh; install_on_device.sh base installs them
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  -d .whl pydantic pydantic-core annotated-types typing-inspection
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  -d .whl "peft==0.21.2" accelerate psutil
ls .whl | grep -E "pydantic|annotated|typing_inspection|peft|accelerate|psutil"
