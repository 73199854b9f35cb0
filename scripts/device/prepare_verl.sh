#!/usr/bin/env bash
# Packs verl 0.9.x and what it needs beyond the GPU image and our other carries into .carry/v1, v2 ...
# (run HERE, in the repo root; issue 27). On the device `install_on_device.sh verl` checks and unpacks it
# into a site directory of its own, /tmp/site_verl, which goes in front of /tmp/site on PYTHONPATH for
# verl's runs only: verl 0.9.1 requires transformers>=5.5.3,<5.11 and tensordict>=0.8,<=0.10 (!=0.9.0),
# while the image has transformers 5.17 and our .whl carries tensordict 0.15.3; our runs never see it.
#
# What it holds, and why (from verl 0.9.1's METADATA and imports, each checked against KINDS.md's image list):
#   verl                        the newest 0.9.x on the registry (VERL_SPEC)
#   transformers 5.10.4         newest below 5.11; it checks tokenizers<=0.23.0 at import, the image has 0.23.2
#   tokenizers 0.22.2           so tokenizers comes along (no cp312 wheel of 0.23.0; huggingface-hub 1.33,
#                               safetensors 0.8: in range)
#   tensordict 0.10.0           + orjson, importlib-metadata (pyvers: in .whl). Its _C.so links no libtorch
#                               (pybind11 only), so the image's torch 2.11 loads it
#   codetiming dill pylatexenc torchdata datasets multiprocess: verl's own requirements the image lacks
#   uvicorn                     verl/workers/rollout/utils.py imports it (verl serves vLLM over HTTP)
#   vLLM's HTTP server path     verl starts vLLM as `vllm serve` (vllm.entrypoints.openai.api_server, cli.serve):
#                               prometheus-fastapi-instrumentator, lm-format-enforcer (+interegular),
#                               outlines-core, lark, mistral-common (+pydantic-extra-types), compressed-tensors
#                               (+loguru), depyf (+astor), watchfiles, python-json-logger, ijson, anthropic
#                               (+docstring-parser, httpx2, httpcore2, truststore), model-hosting-container-
#                               standards (+jmespath, supervisor), mcp (+mcp-types, pyjwt, python-multipart,
#                               sse-starlette): vLLM 0.26.0's declared requirements that neither the image nor
#                               our vLLM carry (prepare_vllm.sh: the offline path only) has. Left out on purpose:
#                               opentelemetry (vLLM imports it in a try block), GPU kernels vLLM does not load
#                               for a dense bf16 model (flashinfer, tilelang, cutlass-dsl, ...), wandb (verl
#                               imports it only for trainer.logger=wandb; we log to console + file).
#   TransferQueue 0.1.11        verl 0.9.1's v1 trainer (the default, trainer.use_v1) imports transfer_queue whatever
#                               transfer_queue.enable says (main_ppo.TaskRunnerV1.run, trainer/ppo/v1/*); its own needs
#                               (pyzmq, msgspec, tensordict, ray, hydra) come with the other carries
#   pycountry 26.2.16           vLLM's structured-output import of transformers 5.10's MistralCommonBackend loads
#                               mistral_common -> pydantic_extra_types.language_code, which needs it (both found
#                               missing on the GPU, 2026-11-27)
# Not here because another carry has them: Ray 2.60 (stripped), hydra-core, omegaconf, pyvers, jsonschema (.whl,
# /work/shared/device/make_device_wheels.sh), vLLM 0.26.0 and pydantic, fastapi, starlette, openai ... (.carry/p1,
# p2: prepare_vllm.sh). verl 0.9.1 accepts vLLM >= 0.18 (verl/third_party/vllm: no upper bound; its `vllm` extra
# pins 0.24.0): 0.26.0 is not a version verl tested. verl wants ray[default]; its runtime_env holds env_vars
# only, so Ray's minimal install (no dashboard) serves it.
#
# Each part <= PART_MIB (56) MiB; every part dir holds the SHA256 of the whole .tar.xz. Device call plan:
# the parts are stashed in /root/.carry by successive calls (the machine forgets them after 30 s idle).
set -euo pipefail
VERL_SPEC=${VERL_SPEC:-verl>=0.9,<0.10}
PART_MIB=${PART_MIB:-56}
PY=${PYTHON:-python3}
DEPS="transformers==5.10.4 tokenizers==0.22.2 tensordict==0.10.0 orjson==3.11.3 importlib-metadata==8.7.0
codetiming==1.4.0 dill==0.4.1 multiprocess==0.70.19 datasets==5.2.0 pylatexenc==2.11 torchdata==0.11.0 uvicorn==0.54.0
prometheus-fastapi-instrumentator==8.1.0 lm-format-enforcer==0.11.3 interegular==0.3.3 outlines-core==0.2.14
lark==1.2.2 mistral-common==1.13.1 pydantic-extra-types==2.11.1 compressed-tensors==0.17.0 loguru==0.7.3
depyf==0.20.0 astor==0.8.1 watchfiles==1.3.0 python-json-logger==4.2.0 ijson==3.6.0 anthropic==2.14.0
docstring-parser==0.18.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 model-hosting-container-standards==0.1.16
jmespath==1.1.0 supervisor==4.3.0 mcp==2.3.0 mcp-types==2.3.0 pyjwt==2.15.1 python-multipart==0.0.34 sse-starlette==3.7.0
TransferQueue==0.1.11 pycountry==26.2.16"
source "$(dirname "$0")/wheel_platform.sh"   # PLAT, git_exclude

root=$(git rev-parse --show-toplevel)
cd "$root"
git_exclude /.carry/

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "downloading $VERL_SPEC and $(echo $DEPS | wc -w) pinned dependencies (--no-deps: the list is the closure) ..."
$PY -m pip download -q --no-deps $PLAT -d "$work/dl" "$VERL_SPEC" $DEPS 2>&1 | grep -v "^WARNING: Location" || true
verl_whl=$(ls "$work"/dl/verl-*.whl)
verl_version=$(basename "$verl_whl" | cut -d- -f2)
[ "$(ls "$work"/dl/*.whl | wc -l)" -eq $(( $(echo $DEPS | wc -w) + 1 )) ] || { echo "a wheel is missing: $(ls "$work"/dl)" >&2; exit 1; }
mkdir -p "$work/site"
for w in "$work"/dl/*.whl; do unzip -q -o "$w" -d "$work/site"; done
(cd "$work/site" && rm -rf ./*.data)
{ echo "verl==$verl_version"; echo "$DEPS" | tr ' ' '\n'; } | sed '/^$/d' > "$work/site/VERL_CARRY_MANIFEST"
echo "verl $verl_version; site: $(du -sh "$work/site" | cut -f1) unpacked; compressing (xz -9) ..."
tar -C "$work/site" -cf - . | xz -9 -T0 > "$work/verl_site.tar.xz"
rm -rf .carry/v[0-9]*
(cd "$work" && split -b "${PART_MIB}m" -d -a 2 verl_site.tar.xz verl_site.tar.xz.part)
sum=$(cd "$work" && sha256sum verl_site.tar.xz | awk '{print $1"  verl_site.tar.xz"}')
i=0
for part in "$work"/verl_site.tar.xz.part*; do
  i=$((i + 1))
  mkdir -p ".carry/v$i"
  mv "$part" ".carry/v$i/"
  echo "$sum" > ".carry/v$i/SHA256.verl"
  echo "$i" > ".carry/v$i/PARTS.verl"  # this part's number; the last dir's number is the count
done
for d in .carry/v*; do echo "$i" > "$d/PARTS.verl"; done
mib() { awk -v b="$1" 'BEGIN{printf "%.1f MiB", b/1048576}'; }
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "verl $verl_version + deps: $(mib "$(stat -c %s "$work/verl_site.tar.xz")") xz in $i part(s):"
for d in .carry/v*; do echo "  $d: $(mib "$(du -sb "$d" | cut -f1)")"; done
echo "working tree that travels with each call: ~$(mib "$tree") (limit per call: 64 MiB in all)"
