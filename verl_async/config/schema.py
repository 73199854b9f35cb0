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
verl's `actor_rollout_ref` group (model, actor, ref, rollout) is in schema_actor_rollout_ref.py,
the allowed values and `rule` in schema_rules.py; this module holds the rest and the root.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from verl_async.config.schema_rules import (
    ADV_ESTIMATORS,
    KL_TYPES,
    KL_CTRL_TYPES,
    TRUNCATIONS,
    DEVICES,
    RESUME_MODES,
    SYNC_TRANSPORTS,
    REWARD_MANAGERS,
    REWARD_MANAGER_SOURCES,
    VERL_IS_LEVELS,
    VERL_CORRECTION_LOSSES,
    PDSR_CAP_MODES,
    rule,
    schema,
)
from verl_async.config.schema_v1 import DistillationConfig, TrainerV1Config, TransferQueueConfig, VerlRewardModelConfig
from verl_async.config.schema_actor_rollout_ref import (  # noqa: F401 - OptimConfig: the keys Megatron adds
    ActorRolloutRefConfig,
    MegatronActorRolloutRefConfig,
    MegatronOptimConfig,
    OptimConfig,
)


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
    reward_model: VerlRewardModelConfig  # a reward model (verl_async/reward_models/)
    sandbox_fusion: Dict[str, Any]  # code-execution rewards: url (null: the built-in sandbox), max_concurrent, memory_limit_mb


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
    val_async: bool  # validate beside training (rollout/background_validation.py); false: while paused
    critic_warmup: int
    default_hdfs_dir: Optional[str]
    del_local_ckpt_after_load: bool
    default_local_dir: str
    max_actor_ckpt_to_keep: Optional[int] = rule(ge=1)
    max_critic_ckpt_to_keep: Optional[int]
    ray_wait_register_center_timeout: int
    worker_timeout_s: float = rule(gt=0)
    max_restarts: int = rule(ge=0)  # the trainer side restarted from its newest checkpoint this often (healing)
    val_timeout_s: Optional[float] = rule(gt=0)  # null: derived (config/derived.py validation_timeout_s)
    finish_timeout_s: Optional[float] = rule(gt=0)  # null: derived (config/derived.py finish_timeout_s)
    cpu_threads_per_worker: Optional[int] = rule(ge=1)  # null: derived (config/derived.py cpu_threads)
    dry_run: bool
    esi_redundant_time: float
    use_legacy_worker_impl: str
    device: str = rule(choices=DEVICES)
    seed: int
    use_v1: bool  # verl's V1 trainer keys (config/verl_v1.py)
    v1: TrainerV1Config


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
    max_replica_restarts: int = rule(ge=0)  # per replica; then retired (rollout/healing.py)
    progress_timeout_s: Optional[float] = rule(gt=0)
    start_timeout_s: Optional[float] = rule(gt=0)  # null: derived (config/derived.py replica_start_timeout_s)


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
    trigger_parameter_sync_step: Optional[int] = rule(ge=1)  # null: derived.auto_trigger_parameter_sync_step
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
    fail_replicas: Any  # null | "all" | list of replica indices or INDEX:KIND entries (config/fault_specs.py)
    fail_trainer: Any  # null | list of rank<R>:die@update<N> / actor:die@sync<V> entries (config/fault_specs.py)


@schema
class RayInitConfig:
    address: Optional[str]
    num_cpus: Optional[int] = rule(ge=1)
    timeline_json_file: Optional[str]
    runtime_env: Dict[str, Any]  # merged onto verl_async's (pipeline.ray_runtime_env), as verl merges it
    prestart_workers: Optional[bool]  # a local Ray's idle worker per CPU, waited for; null: up to 8 CPUs (pipeline)
    preload_modules: List[str]  # the prestarted workers import these when they start (pipeline.ray_init; start-up)


@schema
class RayKwargsInitConfig:
    num_cpus: Optional[int] = rule(ge=1)
    runtime_env: Dict[str, Any]


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
    transfer_queue: TransferQueueConfig
    distillation: DistillationConfig


@schema
class MegatronRootConfig(RootConfig):
    actor_rollout_ref: MegatronActorRolloutRefConfig


def root_schema(strategy: Any) -> type:
    """The schema class for a trainer strategy (actor_rollout_ref.actor.strategy)."""
    return MegatronRootConfig if strategy == "megatron" else RootConfig
