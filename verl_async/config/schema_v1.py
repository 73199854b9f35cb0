"""Typed schema of verl's V1-trainer keys and the verl 0.9 features V1 scripts use beside them.

`trainer.use_v1` / `trainer.v1.*` (the V1 trainer: sync, colocate_async, separate_async and its
replay-buffer sampler), `transfer_queue.*`, `distillation.*` (on-policy distillation) and
`reward.reward_model.*` (a reward model). Defaults live in config/trainer_v1/default.yaml,
config/distillation/default.yaml and the main YAML's `reward` group, as for every key
(schema.py). What the keys mean here: config/verl_v1.py (the mapping onto verl_async's own
keys), verl_async/teachers/ and verl_async/reward_models/ (the runtime), docs/verl_v1.md.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from verl_async.config.schema_rules import rule, schema

V1_TRAINER_MODES = ("sync", "colocate_async", "separate_async")
OFF_POLICY_STRATEGIES = ("drop", "wait")  # verl's ReplayBufferAsync
# verl's registered distillation losses (verl/trainer/distillation/losses.py): single-sample KL estimators of the
# sampled token and the top-k forward KL
DISTILLATION_ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
DISTILLATION_TOPK_MODES = ("forward_kl_topk",)
DISTILLATION_LOSS_MODES = DISTILLATION_ESTIMATOR_MODES + DISTILLATION_TOPK_MODES


# --------------------------------------------------------------------------- trainer.v1
@schema
class HybridRolloutConfig:
    enable_switch: bool  # true: refused (config/verl_v1.py says why)
    switch_threshold_ratio: float = rule(ge=0, le=1)
    adaptive_switch_threshold: bool
    switch_threshold_step_up: float = rule(ge=0)
    switch_threshold_step_down: float = rule(ge=0)
    switch_threshold_release_steps: int = rule(ge=1)
    switch_cost_window_size: int = rule(ge=1)


@schema
class ColocateAsyncConfig:
    num_warmup_batches: float = rule(ge=0)  # batches generated ahead of training (fractional allowed)


@schema
class SeparateAsyncConfig:
    num_warmup_batches: float = rule(ge=0)
    parameter_sync_step: int = rule(ge=1)
    hybrid_rollout: HybridRolloutConfig


@schema
class CustomSamplerConfig:
    path: Optional[str]
    name: Optional[str]


@schema
class SamplerConfig:
    max_off_policy_threshold: Optional[int] = rule(gt=0)  # model versions a trajectory may span; null: no bound
    max_off_policy_strategy: str = rule(choices=OFF_POLICY_STRATEGIES)
    sync_refill_failed_groups: bool
    custom_sampler: CustomSamplerConfig
    sampler_kwargs: Dict[str, Any]


@schema
class TrainerV1Config:
    trainer_mode: str = rule(choices=V1_TRAINER_MODES)
    sync: Dict[str, Any]
    colocate_async: ColocateAsyncConfig
    separate_async: SeparateAsyncConfig
    sampler: SamplerConfig


@schema
class TransferQueueConfig:
    enable: bool  # accepted: the MessageQueue always carries the groups (docs/verl_v1.md)
    metrics: Dict[str, Any]
    backend: Dict[str, Any]


# --------------------------------------------------------------------------- distillation
@schema
class DistillationLossConfig:
    loss_mode: str = rule(choices=DISTILLATION_LOSS_MODES)
    topk: Optional[int] = rule(gt=0)
    use_task_rewards: bool
    distillation_loss_coef: float = rule(ge=0)
    loss_max_clamp: Optional[float] = rule(gt=0)
    log_prob_min_clamp: Optional[float]
    use_policy_gradient: bool
    policy_loss_mode: str = rule(choices=("vanilla",))
    clip_ratio: float = rule(ge=0)
    clip_ratio_low: float = rule(ge=0)
    clip_ratio_high: float = rule(ge=0)


@schema
class DistillationConfig:
    enabled: bool
    n_gpus_per_node: int = rule(ge=0)
    nnodes: int = rule(ge=0)  # 0: the teachers run beside the engine replicas (verl_async/teachers/)
    teacher_models: Dict[str, Any]  # NAME -> {key, model_path, num_replicas, inference}: verl_async/teachers/config.py
    teacher_key: str
    distillation_loss: DistillationLossConfig


# --------------------------------------------------------------------------- reward.reward_model
@schema
class JudgeConfig:
    """A generative judge (an instruct model): verl has no keys for it (its GenRM is a user function posting to
    a router), so these are verl_async's own (verl_async/reward_models/generative.py)."""

    prompt_template: Optional[str]  # {prompt} {response} {ground_truth}; null: the built-in template
    score_pattern: str  # a regex whose first group is the score the judge wrote
    min_score: float
    max_score: float  # the judge's score is mapped from [min_score, max_score] onto [0, 1]


@schema
class VerlRewardModelConfig:
    enable: bool
    enable_resource_pool: bool  # true: devices of its own (n_gpus_per_node x nnodes); false: beside the engines
    n_gpus_per_node: int = rule(ge=0)
    nnodes: int = rule(ge=0)
    model_path: Optional[str]
    rollout: Dict[str, Any]  # verl's RolloutConfig keys for serving it (verl_async/reward_models/config.py)
    use_task_rewards: bool  # verl_async: add the rule reward (reward manager) to the model's score
    reward_model_coef: float  # verl_async: weight of the model's score in the reward
    judge: JudgeConfig
