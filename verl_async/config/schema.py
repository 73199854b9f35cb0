"""Typed schema of the Hydra config (config/*.yaml), as OmegaConf structured dataclasses.

The YAML files hold the default VALUES; these dataclasses hold the TYPES and the
simple per-key rules (allowed choices, bounds). Fields have no defaults on purpose:
a key that is in the schema but not in the YAML shows up as "no value", a key in the
YAML but not in the schema as "unknown key", so the two cannot drift apart silently.
The Megatron variant (MegatronRootConfig) adds the `megatron` sections and the
Megatron optimizer keys; validate() picks it when actor.strategy=megatron.

To add a key: put its default in the YAML and a typed field here, e.g.
    my_key: int = rule(ge=1)            # or a plain annotation: my_key: int
Cross-key rules go in verl_async/config/checks.py. Free-form nodes are Dict[str, Any].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# Allowed values. They mirror the registries of the modules that implement them
# (verl_async.algos, .data, .reward, .utils), which import torch/pyarrow; this module
# must not, so tests/test_config.py checks that the lists agree.
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# kl|k1, abs, mse|k2, low_var_kl|k3; a "+" suffix takes k2's gradient (straight-through), as in verl
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+")
KL_CTRL_TYPES = ("fixed", "adaptive")
POLICY_LOSS_MODES = ("vanilla",)
ROLLOUT_NAMES = ("native", "vllm")
ROLLOUT_DTYPES = ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32")
TRUNCATIONS = ("error", "left", "right", "middle")
DEVICES = ("cuda", "npu", "cpu")  # == verl_async.utils.device.DEVICE_KINDS (not imported: it pulls in torch)
RESUME_MODES = ("auto", "disable", "resume_path")
STRATEGIES = ("fsdp", "fsdp2", "megatron")  # fsdp (verl's FSDP1) runs as fsdp2
SYNC_TRANSPORTS = ("auto", "object_store", "nccl", "hccl", "gloo", "cuda_ipc")
REWARD_MANAGERS = ("naive", "dapo")
LR_SCHEDULERS = ("constant", "cosine")
FSDP_ENGINE_STRATEGIES = ("fsdp", "fsdp2")  # verl 0.9's fsdp_config.strategy; both run as FSDP2
REWARD_MANAGER_SOURCES = ("register", "importlib")  # importlib (a custom class) is refused (config/verl09.py)
VERL_IS_LEVELS = ("token", "sequence")  # verl 0.9's algorithm.rollout_correction.rollout_is
VERL_CORRECTION_LOSSES = ("ppo_clip", "reinforce")  # reinforce is refused (config/verl09.py)
SYNC_BACKENDS = ("nccl", "hccl")  # verl 0.9's rollout.checkpoint_engine.backend -> async_training.sync_transport
MEGATRON_DTYPES = ("bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
MCORE_LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
CORRECTION_MODES = ("truncate", "clip", "mask")
CORRECTION_VETO_RULES = ("old_prob", "ratio")  # == verl_async.algos.rollout_correction.VETO_RULES
PDSR_CAP_MODES = ("l_cut", "probe")  # == verl_async.rollout.pdsr_policy.CAP_MODES
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")  # verl's actor.checkpoint.save_contents
TOOL_CALL_FORMATS = ("hermes",)  # == verl_async.rollout.tool_parser.PARSERS
TRUNCATE_SIDES = ("left", "middle", "right")
SANITY_CHECK_MODES = ("disable", "strict", "ignore_strippable")


def rule(*, choices=None, ge=None, gt=None, le=None) -> Any:
    """A schema field with no default and simple value rules, checked by validate().

    A None value always passes (Optional fields); for list fields `choices` applies to
    each element.
    """
    meta = {k: v for k, v in dict(choices=choices, ge=ge, gt=gt, le=le).items() if v is not None}
    return field(metadata=meta)


schema = dataclass(kw_only=True)


# --------------------------------------------------------------------------- data
@schema
class CustomClsConfig:
    path: Optional[str]
    name: Optional[str]


@schema
class DataConfig:
    tokenizer: Optional[str]
    use_shm: bool
    train_files: Any  # a path, builtin://NAME, or a list of them
    val_files: Any
    prompt_key: str
    reward_fn_key: str
    max_prompt_length: int = rule(gt=0)
    max_response_length: int = rule(gt=0)
    train_batch_size: int
    gen_batch_size: int = rule(ge=1)
    val_batch_size: Optional[int]
    return_raw_input_ids: bool
    return_raw_chat: bool
    return_full_prompt: bool
    shuffle: bool
    seed: Optional[int]
    filter_overlong_prompts: bool
    filter_overlong_prompts_workers: int
    truncation: str = rule(choices=TRUNCATIONS)
    trust_remote_code: bool
    dataloader_num_workers: int = rule(ge=0)
    skip_bad_rows: bool
    custom_cls: CustomClsConfig
    apply_chat_template_kwargs: Dict[str, Any]


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
    lora_alpha: float
    target_modules: Any  # "all-linear" or a list of module names
    exclude_modules: Any


# --------------------------------------------------------------------------- actor
@schema
class PolicyLossConfig:
    loss_mode: str = rule(choices=POLICY_LOSS_MODES)


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
    tensor_model_parallel_size: int = rule(ge=1)
    gpu_memory_utilization: float = rule(gt=0, le=1)
    max_num_batched_tokens: int = rule(gt=0)
    max_model_len: Optional[int] = rule(gt=0)
    max_num_seqs: int = rule(ge=1)
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


# --------------------------------------------------------------------------- the rest
@schema
class CustomRewardFunctionConfig:
    path: Optional[str]
    name: str


@schema
class KLCtrlConfig:
    type: str = rule(choices=KL_CTRL_TYPES)
    kl_coef: float = rule(ge=0)
    horizon: int = rule(gt=0)
    target_kl: float = rule(gt=0)


@schema
class FilterGroupsConfig:
    enable: bool
    metric: Optional[str]
    max_num_gen_batches: int = rule(ge=0)


@schema
class VerlRolloutCorrectionConfig:
    """verl 0.9's algorithm.rollout_correction, translated onto actor.rollout_correction (config/verl09.py)."""

    rollout_is: Optional[str] = rule(choices=VERL_IS_LEVELS)
    rollout_is_threshold: Any  # a number (TIS upper bound) or "lower_upper" (IcePop)
    rollout_is_batch_normalize: bool
    rollout_rs: Optional[str]  # token_k1 | seq_sum_k1 | seq_mean_k1
    rollout_rs_threshold: Any
    bypass_mode: Optional[bool]  # null: async_training.use_rollout_log_probs decides
    loss_type: str = rule(choices=VERL_CORRECTION_LOSSES)


@schema
class AlgorithmConfig:
    gamma: float = rule(ge=0, le=1)
    lam: float = rule(ge=0, le=1)
    adv_estimator: str = rule(choices=ADV_ESTIMATORS)
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool
    kl_penalty: str = rule(choices=KL_TYPES)
    kl_ctrl: KLCtrlConfig
    max_staleness: Optional[int] = rule(ge=0)
    filter_groups: FilterGroupsConfig
    rollout_correction: VerlRolloutCorrectionConfig


@schema
class RewardModelConfig:
    enable: bool
    reward_manager: str = rule(choices=REWARD_MANAGERS)
    launch_reward_fn_async: bool
    timeout_s: float = rule(gt=0)
    num_workers: int = rule(ge=1)
    gsm8k_method: str = rule(choices=("strict", "flexible"))
    max_error_rate: float = rule(ge=0, le=1)
    error_window: int = rule(ge=1)
    reward_kwargs: Dict[str, Any]


@schema
class RewardManagerModuleConfig:
    path: Optional[str]
    name: str


@schema
class VerlRewardManagerConfig:
    source: str = rule(choices=REWARD_MANAGER_SOURCES)
    name: Optional[str] = rule(choices=REWARD_MANAGERS)
    module: RewardManagerModuleConfig


@schema
class VerlCustomRewardFunctionConfig:
    path: Optional[str]
    name: Optional[str]


@schema
class RewardConfig:
    """verl 0.9's `reward` group; a value set here is copied onto reward_model.* / custom_reward_function.*."""

    num_workers: Optional[int] = rule(ge=1)
    reward_manager: VerlRewardManagerConfig
    custom_reward_function: VerlCustomRewardFunctionConfig
    reward_kwargs: Dict[str, Any]
    reward_model: Dict[str, Any]  # model-based rewards: enable=true is refused (checks.py)
    sandbox_fusion: Dict[str, Any]  # code-execution rewards: a url is refused (checks.py)


@schema
class TrainerConfig:
    balance_batch: bool
    total_epochs: int = rule(ge=1)
    total_training_steps: Optional[int] = rule(gt=0)
    project_name: str
    experiment_name: str
    logger: Any  # a list of loggers (a single name is accepted); names checked by checks.loggers
    log_val_generations: int = rule(ge=0)
    rollout_data_dir: Optional[str]
    validation_data_dir: Optional[str]
    nnodes: int = rule(ge=1)
    n_gpus_per_node: int = rule(ge=1)
    node_resource: Optional[str]  # a Ray custom resource the trainer's nodes carry (verl_async/placement.py)
    save_freq: int
    resume_mode: str = rule(choices=RESUME_MODES)
    resume_from_path: Optional[str]
    val_before_train: bool
    val_only: bool
    test_freq: int
    critic_warmup: int
    default_hdfs_dir: Optional[str]
    del_local_ckpt_after_load: bool
    default_local_dir: str
    max_actor_ckpt_to_keep: Optional[int] = rule(ge=1)
    max_critic_ckpt_to_keep: Optional[int]
    ray_wait_register_center_timeout: int
    worker_timeout_s: float = rule(gt=0)
    val_timeout_s: Optional[float] = rule(gt=0)  # null: derived (config/derived.py validation_timeout_s)
    finish_timeout_s: Optional[float] = rule(gt=0)  # null: derived (config/derived.py finish_timeout_s)
    cpu_threads_per_worker: int = rule(ge=1)
    dry_run: bool
    esi_redundant_time: float
    use_legacy_worker_impl: str
    device: str = rule(choices=DEVICES)
    seed: int


@schema
class RolloutResourcesConfig:
    nnodes: int = rule(ge=1)
    n_gpus_per_node: int = rule(ge=1)
    node_resource: Optional[str]  # a Ray custom resource the rollout's nodes carry
    colocate: bool
    total_rollout_steps: Optional[int] = rule(gt=0)
    total_epochs: int = rule(ge=1)
    test_freq: int
    max_prompt_retries: int = rule(ge=0)
    max_consecutive_engine_failures: int = rule(ge=1)
    progress_timeout_s: Optional[float] = rule(gt=0)


@schema
class CheckpointEngineConfig:
    enable: bool
    overlap_broadcast_and_consume: bool
    device_buffer_size_M: int = rule(gt=0)
    bypass_cpu: bool


@schema
class LongTailConfig:
    enable: bool
    offload_ratio: float = rule(ge=0, le=1)
    cap_factor: float = rule(gt=0)
    cap_mode: str = rule(choices=PDSR_CAP_MODES)
    heavy_replicas: int = rule(ge=1)
    fast_max_num_seqs: Optional[int] = rule(ge=1)
    restart: bool
    batch_size: Optional[int] = rule(ge=1)
    batch_timeout_s: float = rule(gt=0)


@schema
class AsyncTrainingConfig:
    staleness_threshold: float = rule(ge=0)
    trigger_parameter_sync_step: int = rule(ge=1)
    require_batches: int = rule(ge=1)
    partial_rollout: bool
    use_rollout_log_probs: bool
    compute_prox_log_prob: bool
    queue_capacity: Optional[int] = rule(ge=1)
    sync_transport: str = rule(choices=SYNC_TRANSPORTS)
    sync_bucket_size_mb: int = rule(gt=0)
    sync_timeout_s: Optional[float] = rule(gt=0)
    checkpoint_engine: CheckpointEngineConfig
    long_tail: LongTailConfig


@schema
class DebugConfig:
    rollout_only: bool
    train_only: bool
    save_rollout_data: Optional[str]
    load_rollout_data: Optional[str]
    save_train_output: Optional[str]
    fail_replicas: Any  # null | "all" | list of engine replica indices (checks.fail_replicas)


@schema
class RayInitConfig:
    address: Optional[str]
    num_cpus: Optional[int] = rule(ge=1)
    timeline_json_file: Optional[str]


@schema
class RayKwargsInitConfig:
    num_cpus: Optional[int] = rule(ge=1)


@schema
class RayKwargsConfig:
    ray_init: RayKwargsInitConfig
    timeline_json_file: Optional[str]


@schema
class RootConfig:
    data: DataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    custom_reward_function: CustomRewardFunctionConfig
    algorithm: AlgorithmConfig
    critic: Dict[str, Any]
    reward_model: RewardModelConfig
    reward: RewardConfig
    trainer: TrainerConfig
    rollout: RolloutResourcesConfig
    async_training: AsyncTrainingConfig
    debug: DebugConfig
    ray_init: RayInitConfig
    ray_kwargs: RayKwargsConfig
    global_profiler: Dict[str, Any]



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


@schema
class MegatronRootConfig(RootConfig):
    actor_rollout_ref: MegatronActorRolloutRefConfig


def root_schema(strategy: Any) -> type:
    """The schema class for a trainer strategy (actor_rollout_ref.actor.strategy)."""
    return MegatronRootConfig if strategy == "megatron" else RootConfig
