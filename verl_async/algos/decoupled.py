"""Decoupled (3-policy) PPO: behaviour = rollout engine, proximal = recomputed old,
target = current policy (slime's mismatch blog, shared/reference/004).

    L = -E_{y ~ pi_rollout} [ pi_old/pi_rollout * min(ratio*A, clip(ratio)*A) ],  ratio = pi/pi_old

The first factor is `rollout_correction`'s weight (truncated/clipped/masked, optionally
batch-normalised); the rest is `ppo_policy_loss` anchored at the proximal policy.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .losses import ppo_policy_loss
from .rollout_correction import rollout_correction


def decoupled_ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    correction: Mapping[str, Any] | None = None,
    **ppo_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """3-policy PPO loss on one batch. `correction` holds `rollout_correction` keyword
    arguments (default: token-level truncate at 2.0, i.e. TIS); `ppo_kwargs` go to
    `ppo_policy_loss` (clip ratios, `loss_agg_mode`, global normalisers).

    The corrected mask (rejection, veto) is the loss mask. With gradient
    accumulation, call `rollout_correction` ONCE on the whole batch (batch
    normalisation and the global counts need all of it), then per micro-batch
    `ppo_policy_loss(..., mask=corrected[mb], is_weights=weights[mb],
    **global_batch_info(corrected masks))` — which is what this does for one batch.
    Metrics: the PPO ones plus the correction's under `rollout_corr/`.
    """
    if "is_weights" in ppo_kwargs:
        raise ValueError("is_weights: decoupled_ppo_loss computes the weights itself (from rollout_logp)")
    weights, loss_mask, corr_metrics = rollout_correction(old_logp, rollout_logp, mask, **dict(correction or {}))
    loss, metrics = ppo_policy_loss(logp, old_logp, advantages, loss_mask, is_weights=weights, **ppo_kwargs)
    metrics.update({f"rollout_corr/{k}": v for k, v in corr_metrics.items()})
    return loss, metrics
