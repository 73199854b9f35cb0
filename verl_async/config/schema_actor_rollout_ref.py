"""Typed schema of verl's `actor_rollout_ref` group: model, actor, ref and rollout (docs in schema.py).

`ActorRolloutRefConfig` is the FSDP2 layout; `MegatronActorRolloutRefConfig` adds the `megatron`
sections and the Megatron optimizer keys (schema.root_schema picks it).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from verl_async.config.schema_rules import (
    LOSS_AGG_MODES,
    KL_TYPES,
    POLICY_LOSS_MODES,
    ROLLOUT_NAMES,
    ROLLOUT_DTYPES,
    STRATEGIES,
    LR_SCHEDULERS,
    FSDP_ENGINE_STRATEGIES,
    SYNC_BACKENDS,
    MEGATRON_DTYPES,
    MCORE_LR_DECAY_STYLES,
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    CORRECTION_VETO_RULES,
    CHECKPOINT_CONTENTS,
    TOOL_CALL_FORMATS,
    TRUNCATE_SIDES,
    SANITY_CHECK_MODES,
    VERL_CORRECTION_LOSSES,
    VERL_IS_LEVELS,
    rule,
    schema,
)


# --------------------------------------------------------------------------- model
@schema
class FusedKernelOptions:
    impl_backend: str


@schema
class ModelConfig:
    path: str
    custom_chat_template: Optional[str]
    external_lib: Optional[str]
    override_config: Dict[str, Any]
    enable_gradient_checkpointing: bool
    enable_activation_offload: bool
    use_remove_padding: bool
    attn_implementation: str = rule(choices=("auto", "sdpa", "eager", "flash_attention_2", "varlen"))
    use_fused_kernels: bool
    fused_kernel_options: FusedKernelOptions
    use_liger: bool
    trust_remote_code: bool
    use_shm: bool
    lora_rank: int = rule(ge=0)
    lora_alpha: float = rule(gt=0)
    target_modules: Any  # "all-linear" or a list of module names
    exclude_modules: Any
    lora_adapter_path: Optional[str]


# --------------------------------------------------------------------------- actor
@schema
class BypassCorrectionConfig:
    """verl 0.9's policy_loss.rollout_correction: the correction the bypass_mode loss computes per micro-batch."""

    rollout_is: Optional[str] = rule(choices=VERL_IS_LEVELS)
    rollout_is_threshold: Any  # a number (truncate) or "lower_upper" (IcePop)
    rollout_is_batch_normalize: bool
    rollout_rs: Optional[str]  # verl's rejection options, comma-separated (checked by config/verl09.py)
    rollout_rs_threshold: Any
    loss_type: str = rule(choices=VERL_CORRECTION_LOSSES)


@schema
class PolicyLossConfig:
    loss_mode: str = rule(choices=POLICY_LOSS_MODES)
    clip_cov_ratio: float = rule(gt=0)
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float = rule(gt=0)
    ppo_kl_coef: float
    dro_beta: Optional[float] = rule(gt=0)
    rollout_correction: BypassCorrectionConfig


@schema
class RolloutCorrectionConfig:
    enable: bool
    level: str = rule(choices=CORRECTION_LEVELS)
    mode: str = rule(choices=CORRECTION_MODES)
    lower: Optional[float] = rule(gt=0)
    upper: Optional[float] = rule(gt=0)  # None: no upper bound
    rs: bool
    rs_level: Optional[str] = rule(choices=CORRECTION_LEVELS)
    rs_lower: Optional[float] = rule(ge=0)
    rs_upper: Optional[float] = rule(gt=0)
    veto_threshold: Optional[float] = rule(gt=0, le=1)
    veto_rule: str = rule(choices=CORRECTION_VETO_RULES)
    batch_normalize: bool


@schema
class OptimConfig:
    lr: float = rule(ge=0)
    lr_warmup_steps: int
    lr_warmup_steps_ratio: float = rule(ge=0, le=1)
    min_lr_ratio: Optional[float] = rule(ge=0, le=1)
    num_cycles: float
    lr_scheduler_type: str = rule(choices=LR_SCHEDULERS)
    warmup_style: Optional[str] = rule(choices=LR_SCHEDULERS)  # verl's old name of lr_scheduler_type
    total_training_steps: int
    weight_decay: float = rule(ge=0)
    betas: List[float]
    eps: float = rule(gt=0)
    clip_grad: float = rule(ge=0)
    override_optimizer_config: Dict[str, Any]


@schema
class MegatronOptimConfig(OptimConfig):
    optimizer: str
    lr_decay_steps: Optional[int]
    lr_decay_style: str = rule(choices=MCORE_LR_DECAY_STYLES)
    lr_warmup_init: float
    min_lr: float = rule(ge=0)
    weight_decay_incr_style: str
    lr_wsd_decay_style: str
    lr_wsd_decay_steps: Optional[int]
    use_checkpoint_opt_param_scheduler: bool


@schema
class MixedPrecisionConfig:
    param_dtype: str
    reduce_dtype: str


@schema
class WrapPolicyConfig:
    min_num_params: int = rule(ge=0)


@schema
class FSDPConfig:
    strategy: Optional[str] = rule(choices=FSDP_ENGINE_STRATEGIES)  # verl 0.9; null: actor.strategy decides
    param_offload: bool
    optimizer_offload: bool
    offload_policy: bool
    reshard_after_forward: bool
    fsdp_size: int
    forward_prefetch: bool
    grad_accum_no_sync: bool
    mixed_precision: MixedPrecisionConfig
    wrap_policy: WrapPolicyConfig


@schema
class RefFSDPConfig:
    strategy: Optional[str] = rule(choices=FSDP_ENGINE_STRATEGIES)
    param_offload: bool
    reshard_after_forward: bool
    wrap_policy: WrapPolicyConfig


@schema
class MegatronConfig:
    param_offload: bool
    tensor_model_parallel_size: int = rule(ge=1)
    expert_model_parallel_size: int = rule(ge=1)
    expert_tensor_parallel_size: Optional[int] = rule(ge=1)
    pipeline_model_parallel_size: int = rule(ge=1)
    virtual_pipeline_model_parallel_size: Optional[int] = rule(ge=1)
    context_parallel_size: int = rule(ge=1)
    sequence_parallel: bool
    use_distributed_optimizer: bool
    use_dist_checkpointing: bool
    dist_checkpointing_path: Optional[str]
    seed: int
    dtype: str = rule(choices=MEGATRON_DTYPES)
    use_mbridge: bool
    vanilla_mbridge: bool  # verl 0.9: legacy mbridge instead of Megatron-Bridge (compatibility: we convert)
    use_remove_padding: bool  # verl 0.9: THD-packed sequences in Megatron (compatibility: rows run right-padded)
    override_transformer_config: Dict[str, Any]


@schema
class ActorMegatronConfig(MegatronConfig):
    grad_offload: bool
    optimizer_offload: bool


@schema
class CheckpointConfig:
    save_contents: List[str] = rule(choices=CHECKPOINT_CONTENTS)
    load_contents: List[str] = rule(choices=CHECKPOINT_CONTENTS)


@schema
class ActorConfig:
    strategy: str = rule(choices=STRATEGIES)
    ppo_mini_batch_size: int = rule(gt=0)
    ppo_micro_batch_size: Optional[int] = rule(gt=0)  # verl's global micro-batch; converted to per-GPU
    ppo_micro_batch_size_per_gpu: Optional[int] = rule(gt=0)
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: Optional[int] = rule(gt=0)
    ppo_epochs: int = rule(ge=1)
    shuffle: bool
    grad_clip: float = rule(ge=0)
    clip_ratio: float = rule(ge=0)
    clip_ratio_low: Optional[float] = rule(ge=0)
    clip_ratio_high: Optional[float] = rule(ge=0)
    clip_ratio_c: float = rule(gt=1)
    tau_pos: float = rule(gt=0)  # sapo
    tau_neg: float = rule(gt=0)
    loss_agg_mode: str = rule(choices=LOSS_AGG_MODES)
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float = rule(ge=0)
    kl_loss_type: str = rule(choices=KL_TYPES)
    use_torch_compile: Optional[bool]
    ulysses_sequence_parallel_size: int = rule(ge=1)
    entropy_from_logits_with_chunking: bool
    entropy_checkpointing: bool
    use_rollout_log_probs: bool
    policy_loss: PolicyLossConfig
    rollout_correction: RolloutCorrectionConfig
    optim: OptimConfig
    fsdp_config: FSDPConfig
    checkpoint: CheckpointConfig


@schema
class RefConfig:
    strategy: str = rule(choices=STRATEGIES)
    use_torch_compile: Optional[bool]
    log_prob_micro_batch_size: Optional[int] = rule(gt=0)
    log_prob_micro_batch_size_per_gpu: Optional[int] = rule(gt=0)
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: Optional[int] = rule(gt=0)
    ulysses_sequence_parallel_size: int = rule(ge=1)
    fsdp_config: RefFSDPConfig


# --------------------------------------------------------------------------- rollout
@schema
class ValKwargsConfig:
    top_k: int = rule(ge=-1)
    top_p: float = rule(gt=0, le=1)
    temperature: float = rule(ge=0)
    n: int = rule(ge=1)
    do_sample: bool


@schema
class MultiTurnConfig:
    enable: bool
    max_assistant_turns: Optional[int] = rule(ge=1)
    max_user_turns: Optional[int] = rule(ge=1)
    max_parallel_calls: int = rule(ge=1)
    max_tool_response_length: int = rule(gt=0)
    tool_response_truncate_side: str = rule(choices=TRUNCATE_SIDES)
    tool_config_path: Optional[str]
    function_tool_path: Optional[str]
    format: str = rule(choices=TOOL_CALL_FORMATS)
    tool_timeout_s: float = rule(gt=0)
    use_inference_chat_template: bool
    tokenization_sanity_check_mode: str = rule(choices=SANITY_CHECK_MODES)
    num_repeat_rollouts: Optional[int]


@schema
class RolloutCheckpointEngineConfig:
    """verl 0.9's weight-sync settings, copied onto async_training.* by validation."""

    backend: Optional[str] = rule(choices=SYNC_BACKENDS)
    update_weights_bucket_megabytes: Optional[int] = rule(gt=0)


@schema
class RolloutConfig:
    name: str = rule(choices=ROLLOUT_NAMES)
    mode: str
    enable_sleep_mode: bool  # verl: let vLLM sleep between rollouts (compatibility: fully async engines never sleep)
    layered_summon: bool  # verl: gather LoRA layers one by one for the sync (compatibility: always per parameter)
    n: int = rule(ge=1)
    temperature: float = rule(ge=0)
    top_k: int = rule(ge=-1)
    top_p: float = rule(gt=0, le=1)
    do_sample: bool
    prompt_length: int = rule(gt=0)
    response_length: int = rule(gt=0)
    dtype: str = rule(choices=ROLLOUT_DTYPES)
    ignore_eos: bool
    calculate_log_probs: bool
    true_on_policy: bool
    tensor_model_parallel_size: int = rule(ge=1)
    gpu_memory_utilization: float = rule(gt=0, le=1)
    max_num_batched_tokens: int = rule(gt=0)
    max_model_len: Optional[int] = rule(gt=0)
    max_num_seqs: Optional[int] = rule(ge=1)  # null: sized from memory on CUDA (rollout/native/sizing.py), 64 elsewhere
    kv_cache_tokens: Optional[int] = rule(gt=0)
    enforce_eager: Optional[bool]
    free_cache_engine: bool
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    load_format: str
    disable_log_stats: bool
    seed: int
    log_prob_micro_batch_size: Optional[int] = rule(gt=0)
    log_prob_micro_batch_size_per_gpu: Optional[int] = rule(gt=0)
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: Optional[int] = rule(gt=0)
    multi_turn: MultiTurnConfig
    val_kwargs: ValKwargsConfig
    engine_kwargs: Dict[str, Any]
    checkpoint_engine: RolloutCheckpointEngineConfig


@schema
class ActorRolloutRefConfig:
    hybrid_engine: bool
    nccl_timeout: int = rule(gt=0)
    model: ModelConfig
    actor: ActorConfig
    ref: RefConfig
    rollout: RolloutConfig


# --------------------------------------------------------------------------- megatron
@schema
class MegatronActorConfig(ActorConfig):
    optim: MegatronOptimConfig
    megatron: ActorMegatronConfig


@schema
class MegatronRefConfig(RefConfig):
    megatron: MegatronConfig


@schema
class MegatronActorRolloutRefConfig(ActorRolloutRefConfig):
    actor: MegatronActorConfig
    ref: MegatronRefConfig
