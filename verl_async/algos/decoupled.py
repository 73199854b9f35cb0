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
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    correction: Mapping[str, Any] | None = None,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """3-policy PPO loss on one batch. `correction` holds `rollout_correction` keyword
    arguments (default: token-level truncate at 2.0, i.e. TIS).

    The corrected mask (rejection, veto) is the loss mask. With gradient
    accumulation, call `rollout_correction` ONCE on the whole batch (batch
    normalisation and the global counts need all of it), then per micro-batch
    `ppo_policy_loss(..., mask=corrected[mb], is_weights=weights[mb],
    **global_batch_info(corrected masks))` — which is what this does for one batch.
    Metrics: the PPO ones plus the correction's under `rollout_corr/`.
    """
    weights, loss_mask, corr_metrics = rollout_correction(old_logp, rollout_logp, mask, **dict(correction or {}))
    loss, metrics = ppo_policy_loss(
        logp,
        old_logp,
        advantages,
        loss_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        is_weights=weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    metrics.update({f"rollout_corr/{k}": v for k, v in corr_metrics.items()})
    return loss, metrics
