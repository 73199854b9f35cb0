#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-0.5B-Instruct: Megatron-core trainer on Ascend NPU, fully async.
# The user's launch script (../shared/reference/003, run on 1 NPU for training + 1 for
# rollout) on verl_async: same keys and values; only these differ.
#   - module: python -m recipe.fully_async_main (run from the repository root).
#   - paths from the environment: MODEL_PATH, TRAIN_FILE, TEST_FILE (verl's gsm8k parquet:
#     python data_preprocess/gsm8k.py), CKPTS_DIR, LOG_FILE; MEGATRON_LM_DIR / MINDSPEED_DIR
#     are put on PYTHONPATH when set (or pip install megatron-core / mindspeed).
#   - trainer.device=npu: torch_npu + HCCL through verl_async.utils.device; the Megatron
#     ranks import torch_npu.contrib.transfer_to_npu and, when installed, MindSpeed's
#     megatron_adaptor before megatron-core (verl_async.trainer.megatron.device_shim).
#   - rollout engine: ROLLOUT_NAME, default vllm when vllm-ascend is installed and
#     verl_async has a vllm engine registered, else the native engine (torch_npu).
#   - fusion / optimizer overrides kept as written: with MindSpeed they pass through to
#     its patched TransformerConfig; without it, the ranks turn off the ones whose kernels
#     are missing and log one line each (see README, "NPU and Megatron").
# Extra Hydra overrides can be appended: bash scripts/run_...npu.sh trainer.total_epochs=2
# VERL_ASYNC_DRY_RUN=1 checks config, device and data and starts nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

for dir in "${MINDSPEED_DIR:-}" "${MEGATRON_LM_DIR:-}"; do
    [ -n "$dir" ] && export PYTHONPATH="$dir:${PYTHONPATH:-}"
done
PYTHON=${PYTHON:-python}
MODEL_PATH=${MODEL_PATH:?set MODEL_PATH to a local Qwen2.5-0.5B-Instruct folder}
TRAIN_FILE=${TRAIN_FILE:?set TRAIN_FILE to gsm8k train.parquet}
TEST_FILE=${TEST_FILE:?set TEST_FILE to gsm8k test.parquet}
project_name=GRPO_Qwen2.5_0.5b
exp_name=${EXP_NAME:-npu_async_$(date +%Y%m%d_%H%M%S)}
CKPTS_DIR=${CKPTS_DIR:-"$HOME/verl/ckpts/$project_name/$exp_name"}
LOG_FILE=${LOG_FILE:-"$CKPTS_DIR/train.log"}
mkdir -p "$(dirname "$LOG_FILE")"
if [ -z "${ROLLOUT_NAME:-}" ]; then
    ROLLOUT_NAME=native
    if $PYTHON -c "import vllm_ascend" 2>/dev/null && $PYTHON -c \
        "import sys; from verl_async.rollout.registry import ENGINES; sys.exit('vllm' not in ENGINES)" 2>/dev/null; then
        ROLLOUT_NAME=vllm
        export VLLM_USE_V1=1
    fi
fi
echo "rollout engine: $ROLLOUT_NAME; log: $LOG_FILE"

max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 4))
max_len=$((max_prompt_length + max_response_length))
total_rollout_steps=$((512 * 1000))
offload=True
A=actor_rollout_ref.actor
M=$A.megatron
T=+$M.override_transformer_config
O=+$A.optim.override_optimizer_config

$PYTHON -m recipe.fully_async_main \
    --config-path=config --config-name=fully_async_ppo_megatron_trainer.yaml \
    data.train_files="$TRAIN_FILE" data.val_files="$TEST_FILE" data.prompt_key=prompt data.truncation=error \
    data.max_prompt_length=$max_prompt_length data.max_response_length=$max_response_length \
    data.train_batch_size=0 data.return_raw_chat=True data.filter_overlong_prompts=False \
    algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.001 \
    actor_rollout_ref.model.path="$MODEL_PATH" actor_rollout_ref.model.enable_gradient_checkpointing=True \
    +actor_rollout_ref.model.override_config.model_config.max_position_embeddings=$max_len \
    actor_rollout_ref.model.use_fused_kernels=False actor_rollout_ref.model.use_remove_padding=False \
    $A.use_kl_loss=True $A.kl_loss_coef=0.001 \
    $A.clip_ratio_low=0.2 $A.clip_ratio_high=0.2 $A.clip_ratio_c=3 \
    $A.entropy_coeff=0.001 $A.loss_agg_mode=token-mean \
    $A.use_dynamic_bsz=True $A.ppo_mini_batch_size=64 $A.ppo_micro_batch_size_per_gpu=32 \
    $A.ppo_max_token_len_per_gpu=$max_len \
    $A.optim.lr=5e-7 $A.optim.lr_warmup_steps=-1 $A.optim.lr_decay_style=constant $A.optim.weight_decay=0.01 \
    $A.optim.lr_decay_steps=$total_rollout_steps \
    $O.optimizer_offload_fraction=0 $O.overlap_cpu_optimizer_d2h_h2d=True \
    $O.use_precision_aware_optimizer=True $O.optimizer_cpu_offload=True \
    $M.use_mbridge=False $M.use_dist_checkpointing=False \
    $M.param_offload=$offload $M.grad_offload=$offload $M.optimizer_offload=$offload \
    $M.tensor_model_parallel_size=1 $M.pipeline_model_parallel_size=1 $M.virtual_pipeline_model_parallel_size=null \
    $M.context_parallel_size=1 $M.expert_model_parallel_size=1 $M.expert_tensor_parallel_size=1 \
    $T.apply_rope_fusion=True $T.masked_softmax_fusion=True $T.bias_activation_fusion=True \
    $T.bias_dropout_fusion=True $T.gradient_accumulation_fusion=True $T.deallocate_pipeline_outputs=True \
    $T.persist_layer_norm=True $T.use_flash_attn=True \
    actor_rollout_ref.ref.megatron.param_offload=$offload actor_rollout_ref.ref.megatron.use_dist_checkpointing=False \
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1 actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1 \
    actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=null actor_rollout_ref.ref.megatron.context_parallel_size=1 \
    actor_rollout_ref.ref.megatron.expert_model_parallel_size=1 actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=1 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$max_len \
    actor_rollout_ref.rollout.name=$ROLLOUT_NAME actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$max_len \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.7 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.enable_chunked_prefill=False actor_rollout_ref.rollout.max_num_batched_tokens=$max_len \
    actor_rollout_ref.rollout.temperature=0.7 actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1 \
    actor_rollout_ref.rollout.val_kwargs.temperature=0.7 actor_rollout_ref.rollout.val_kwargs.top_p=0.7 \
    actor_rollout_ref.rollout.val_kwargs.top_k=-1 actor_rollout_ref.rollout.val_kwargs.do_sample=True \
    actor_rollout_ref.rollout.val_kwargs.n=1 actor_rollout_ref.rollout.enforce_eager=True \
    actor_rollout_ref.rollout.calculate_log_probs=True actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.free_cache_engine=True actor_rollout_ref.hybrid_engine=False \
    reward_model.reward_manager=dapo \
    +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True +reward_model.reward_kwargs.overlong_buffer_cfg.len=512 \
    +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 +reward_model.reward_kwargs.overlong_buffer_cfg.log=False \
    +reward_model.reward_kwargs.max_resp_len=$max_response_length \
    trainer.logger='[console,tensorboard]' trainer.project_name=$project_name trainer.experiment_name="$exp_name" \
    trainer.default_local_dir="$CKPTS_DIR" trainer.val_before_train=False trainer.save_freq=-1 trainer.total_epochs=1 \
    trainer.resume_mode=auto trainer.log_val_generations=10 \
    trainer.device=npu trainer.nnodes=1 trainer.n_gpus_per_node=1 \
    rollout.nnodes=1 rollout.n_gpus_per_node=1 rollout.total_rollout_steps=$total_rollout_steps rollout.total_epochs=1 \
    rollout.test_freq=5 \
    async_training.staleness_threshold=0.2 async_training.trigger_parameter_sync_step=4 \
    async_training.require_batches=1 async_training.partial_rollout=False async_training.use_rollout_log_probs=True \
    "$@" 2>&1 | tee "$LOG_FILE"
