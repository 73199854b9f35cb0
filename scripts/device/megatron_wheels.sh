#!/usr/bin/env bash
# Here (the repository root, on the machine with pip access): fill ./.whl with what the
# lent GPU machine lacks, megatron-core included (its image has torch, transformers,
# pyarrow ... but no Ray, Hydra, tensordict or megatron-core). megatron-core 0.16.1 is
# a 2.6 MB cp312 manylinux wheel whose own needs (torch, numpy, packaging) the image has.
#   bash scripts/device/megatron_wheels.sh            # then carry ".whl" in the device call
# SHARED_DEVICE_DIR: where make_device_wheels.sh lives (default ../shared/device).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
SHARED=${SHARED_DEVICE_DIR:-../shared/device}
MEGATRON_CORE=${MEGATRON_CORE:-megatron-core==0.16.1}
bash "$SHARED/make_device_wheels.sh" "$MEGATRON_CORE"
ls .whl/megatron_core-*.whl
# The same wheel alone in .carry/mc, for calls whose carry is full (.whl + the model's .carry/m2 leave no
# room): carry .carry/mc in a stash call (install_on_device.sh stash) and megatron_gpu_check.sh installs it.
mkdir -p .carry/mc && rm -f .carry/mc/megatron_core-*.whl && cp .whl/megatron_core-*.whl .carry/mc/
