#!/usr/bin/env bash
# Packs vLLM 0.26.0 and the packages the lent GPU image lacks into .carry/ (run HERE, in the repo root).
#
# The image (KINDS.md) has torch 2.11.0+cu130 (vLLM 0.26.0 pins exactly that), transformers 5.17,
# triton, numpy, aiohttp, uvloop, prometheus-client, ... but neither vLLM nor these of its imports:
# pydantic (+core, annotated-types, typing-inspection, typing-extensions>=4.16), pyzmq, msgspec,
# cbor2, pybase64, cachetools, setproctitle, blake3, openai 2.x (+distro, jiter, sniffio),
# openai-harmony, llguidance, xgrammar (+apache-tvm-ffi), fastapi, starlette. That list was found by
# importing vLLM's offline path (AsyncLLM, EngineCore, GPU worker and model runner, Qwen2, FlashAttention
# backend, sampler, loaders) with everything the image lacks blocked; vLLM's server-only extras
# (anthropic, mcp, opentelemetry, watchfiles, ...) and optional kernels (flashinfer, deep_gemm,
# cutlass-dsl, tilelang, quack, ...) are not needed for generation with a bf16 Qwen2 model.
#
# vLLM is stripped of what an H100/H200 run of a dense bf16 model never loads: FlashAttention-2's
# library (Hopper uses FA3), the Rust frontend binary vllm-rs, MoE / FlashMLA / QuTLASS kernels,
# DeepGEMM and the SM100 FMHA sources. What is left (the _C kernels: 56 MB of xz, FA3: 8 MB, Python)
# plus the dependencies is one tar.xz, split in two parts:
#   .carry/p1/  part 00                          -> device call 1 (carry .carry/p1)
#   .carry/p2/  the remaining part(s)            -> device call 2 (carry .carry/p2; .whl in a call of its own)
# .whl/ (Ray, Hydra, OmegaConf, tensordict: /work/shared/device/make_device_wheels.sh) is made if missing.
# On the device: scripts/device/install_on_device.sh stashes the parts in /root/.carry, checks their
# sha256 and unpacks everything into /tmp/site (PYTHONPATH).
set -euo pipefail
VLLM=${VLLM_VERSION:-0.26.0}
PART_MIB=${PART_MIB:-48}   # + the ~9 MiB working tree: under the 64 MiB per call
PY=${PYTHON:-python3}
# partial-json-parser (pure Python): not on AsyncLLM's path, but vllm.LLM imports it (llm.py -> pooling -> vllm.tool_parsers)
DEPS="pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
pyzmq==27.3.0 msgspec==0.22.0 cbor2==6.2.1 pybase64==1.5.1 cachetools==8.0.1 setproctitle==1.3.8 blake3==1.0.11
openai==2.54.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 openai-harmony==0.0.8 llguidance==1.7.6 xgrammar==0.2.8
apache-tvm-ffi==0.1.15.post2 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7"
STRIP="vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/_moe_C_stable_libtorch.abi3.so vllm/_qutlass_C.abi3.so
vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so vllm/third_party/deep_gemm vllm/third_party/fmha_sm100"
source "$(dirname "$0")/wheel_platform.sh"   # PLAT, git_exclude

root=$(git rev-parse --show-toplevel)
cd "$root"
git_exclude /.carry/ /.whl/
[ -f .whl/ray312.tar.xz ] || bash /work/shared/device/make_device_wheels.sh
[ -f .whl/install_on_device.sh ] || cp /work/shared/device/install_on_device.sh .whl/

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "downloading vllm==$VLLM and $(echo $DEPS | wc -w) dependencies (no deps of deps: all pinned) ..."
$PY -m pip download -q --no-deps $PLAT -d "$work/dl" "vllm==$VLLM" $DEPS
mkdir -p "$work/site"
for w in "$work"/dl/*.whl; do unzip -q -o "$w" -d "$work/site"; done
(cd "$work/site" && rm -rf $STRIP && rm -rf ./*.data)
{ echo "vllm==$VLLM"; echo "$DEPS" | tr ' ' '\n'; } | sed '/^$/d' > "$work/site/VERL_ASYNC_CARRY_MANIFEST"
echo "site: $(du -sh "$work/site" | cut -f1) unpacked; compressing (xz -9, a few minutes) ..."
tar -C "$work/site" -cf - . | xz -9 -T0 > "$work/vllm_site.tar.xz"
rm -rf .carry/p1 .carry/p2 && mkdir -p .carry/p1 .carry/p2   # the model parts (.carry/m1, m2) stay
(cd "$work" && split -b "${PART_MIB}m" -d -a 2 vllm_site.tar.xz vllm_site.tar.xz.part)
mv "$work"/vllm_site.tar.xz.part00 .carry/p1/
mv "$work"/vllm_site.tar.xz.part* .carry/p2/ 2>/dev/null || true
(cd "$work" && sha256sum vllm_site.tar.xz) | awk '{print $1"  vllm_site.tar.xz"}' > .carry/p1/SHA256
cp .carry/p1/SHA256 .carry/p2/SHA256
total=$(stat -c %s "$work/vllm_site.tar.xz")
p1=$(du -sb .carry/p1 | cut -f1); p2=$(du -sb .carry/p2 | cut -f1); whl=$(du -sb .whl | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
mib() { awk -v b="$1" 'BEGIN{printf "%.1f MiB", b/1048576}'; }
echo "vllm + deps: $(mib "$total") xz; call 1 carries .carry/p1 = $(mib "$p1"); call 2 carries .carry/p2 = $(mib "$p2"); .whl = $(mib "$whl") goes alone"
echo "working tree that travels with each call: ~$(mib "$tree") (limit per call: 64 MiB in all)"
if [ $((p1 + tree)) -gt $((62 * 1048576)) ] || [ $((p2 + tree)) -gt $((62 * 1048576)) ]; then
  echo "WARNING: a call would exceed ~62 MiB; lower PART_MIB and carry a third part" >&2
  exit 1
fi
