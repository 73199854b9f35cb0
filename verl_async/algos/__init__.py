"""RL algorithm library: pure torch functions, no Ray, no config objects, no globals.

Shapes: per-token tensors are `[B, T]` with a 0/1 `response_mask`. Semantics follow
verl (core_algos, seqlen_balancing) and slime (TIS/MIS), so curves compare across
frameworks. Log-prob convention (shared with the rollout engines):
`log_softmax(logits.float() / temperature)[token]`, temperature 0/None means 1.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    compute_grpo_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_rloo_advantage,
    masked_whiten,
    scores_to_token_rewards,
)
from .balancing import greedy_partition, karmarkar_karp, partition_by_token_cap, spread
from .decoupled import decoupled_ppo_loss
from .kl import KL_KINDS, adaptive_kl_coef, kl_in_reward, kl_penalty
from .logprob import (
    entropy_from_logits,
    logprob_temperature,
    logprobs_and_entropy,
    logprobs_from_logits,
    normalize_temperature,
)
from .losses import LOSS_AGG_MODES, agg_loss, global_batch_info, ppo_policy_loss, ratio_deviation_max
from .packing import Pack, pack_sequences, unpack_sequences
from .policy_losses import POLICY_LOSSES, compute_policy_loss
from .rollout_correction import rollout_correction, vetoed_sequences

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "Pack",
    "adaptive_kl_coef",
    "agg_loss",
    "compute_advantages",
    "compute_grpo_advantage",
    "compute_policy_loss",
    "compute_reinforce_plus_plus_advantage",
    "compute_rloo_advantage",
    "decoupled_ppo_loss",
    "entropy_from_logits",
    "global_batch_info",
    "greedy_partition",
    "karmarkar_karp",
    "kl_in_reward",
    "kl_penalty",
    "logprob_temperature",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "masked_whiten",
    "normalize_temperature",
    "pack_sequences",
    "partition_by_token_cap",
    "ppo_policy_loss",
    "ratio_deviation_max",
    "rollout_correction",
    "scores_to_token_rewards",
    "spread",
    "unpack_sequences",
    "vetoed_sequences",
]
