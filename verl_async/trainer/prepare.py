"""A training step's algorithm on the driver, in one place (docs/architecture.md "One sample's way", step 8).

From the collated batch of a step's groups to the batch the worker group trains on:

1. old log-probs: recomputed by the worker group (with entropy and the train/rollout
   mismatch metrics), or the rollout's in bypass mode (`async_training.use_rollout_log_probs`);
2. reference log-probs when a KL term is on (`actor.use_kl_loss`, `algorithm.use_kl_in_reward`);
3. KL-shaped token rewards (`use_kl_in_reward`) and the next step's coefficient (`kl_ctrl`);
4. advantages (`algorithm.adv_estimator`);
5. the loss mask, and the rollout-correction weights when `actor.rollout_correction.enable`.

The math is pure (tensors in, tensors out; the formulas are in `verl_async.algos`);
`prepare_batch` orders it and is the only part that calls the worker group (for the
forward passes). The loss itself is `trainer/loss.py`, run on the ranks.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional, Protocol

import torch

from verl_async.algos import (
    adaptive_kl_coef,
    compute_advantages,
    compute_reinforce_plus_plus_advantage,
    kl_in_reward,
    kl_penalty,
    rollout_correction,
)
from verl_async.algos.advantages import scores_to_token_rewards
from verl_async.config.derived import recomputes_old_log_probs, uses_reference_policy
from verl_async.trainer.settings import RolloutCorrectionSettings

if TYPE_CHECKING:  # tensordict (and torch._dynamo under it) loads with the first batch, not at start-up
    from tensordict import TensorDict


class LogProbSource(Protocol):
    """What `prepare_batch` needs of a worker group: the two forward passes."""

    def compute_log_prob(self, batch: TensorDict, *, calculate_entropy: bool = False) -> Any: ...

    def compute_ref_log_prob(self, batch: TensorDict) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepAlgorithm:
    """The keys a step's algorithm reads, read once from the config (so the math below takes no config)."""

    recompute_old_log_probs: bool
    use_reference: bool
    use_kl_in_reward: bool
    kl_penalty: str
    kl_ctrl_type: str  # fixed | adaptive
    target_kl: float
    kl_horizon: int
    adv_estimator: str
    norm_adv_by_std_in_grpo: bool
    gamma: float
    correction: RolloutCorrectionSettings

    @classmethod
    def from_config(cls, cfg: Any) -> "StepAlgorithm":
        algo = cfg.algorithm
        return cls(
            recompute_old_log_probs=recomputes_old_log_probs(cfg),
            use_reference=uses_reference_policy(cfg),
            use_kl_in_reward=bool(algo.use_kl_in_reward),
            kl_penalty=str(algo.kl_penalty),
            kl_ctrl_type=str(algo.kl_ctrl.type),
            target_kl=float(algo.kl_ctrl.target_kl),
            kl_horizon=int(algo.kl_ctrl.horizon),
            adv_estimator=str(algo.adv_estimator),
            norm_adv_by_std_in_grpo=bool(algo.norm_adv_by_std_in_grpo),
            gamma=float(algo.gamma),
            correction=RolloutCorrectionSettings.from_config(cfg),
        )


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def same_version_tokens(token_versions: torch.Tensor, version: int, local_updates: int = 0) -> torch.Tensor:
    """[B, T] bool: the tokens sampled by exactly the weights the trainer recomputes with. Engines only
    ever hold pushed versions, so after a local optimizer step (not pushed yet) there are none."""
    if local_updates:
        return torch.zeros_like(token_versions, dtype=torch.bool)
    return token_versions == version


def mismatch_metrics(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, same_version: Optional[torch.Tensor] = None
) -> dict[str, float]:
    """How far the recomputed old log-probs are from the rollout's (only measured when recomputed).

    Under asynchrony the gap has two parts: policy drift (a token sampled by an older version than
    the trainer's) and the kernels' train/inference mismatch. `same_version` (tokens sampled by the
    weights the trainer recomputes with) isolates the second: `mismatch/same_version_*` is what true
    on-policy mode makes exactly 0 in a fully async run. Absent when no such token is in the batch.
    """
    diff = (old - rollout).abs()
    r = rollout - old
    out = {
        "mismatch/train_rollout_logprob_abs_diff": _masked_mean(diff, mask),
        "mismatch/train_rollout_logprob_abs_diff_max": float((diff * mask).max()) if mask.any() else 0.0,
        "mismatch/k3_kl": _masked_mean(torch.exp(r) - r - 1, mask),
    }
    if same_version is not None:
        same = mask.bool() & same_version
        out["mismatch/same_version_token_frac"] = float(same.sum()) / max(int(mask.bool().sum()), 1)
        if same.any():
            out["mismatch/same_version_logprob_abs_diff"] = _masked_mean(diff, same)
            out["mismatch/same_version_logprob_abs_diff_max"] = float(diff[same].max())
    return out


def next_kl_coef(kind: str, coef: float, current_kl: float, *, target_kl: float, horizon: int, n_steps: int) -> float:
    """The in-reward KL coefficient of the next step (`algorithm.kl_ctrl`, verl semantics):
    `fixed` keeps it; `adaptive` steers the measured KL towards `target_kl` over `horizon`."""
    if kind == "fixed":
        return coef
    return adaptive_kl_coef(coef, current_kl, target_kl=target_kl, horizon=horizon, n_steps=n_steps)


def step_advantages(
    algo: StepAlgorithm,
    scores: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor,
    old: torch.Tensor,
    ref: Optional[torch.Tensor],
    kl_coef: float,
) -> tuple[torch.Tensor, dict[str, float], float]:
    """Advantages `[B, T]` of the step's scores (KL-shaped first when `use_kl_in_reward`).

    Returns (advantages, metrics, the KL coefficient of the next step).
    """
    metrics: dict[str, float] = {}
    next_coef = kl_coef
    if algo.use_kl_in_reward:
        assert ref is not None, "use_kl_in_reward implies reference log-probs"
        token_rewards, mean_kl = kl_in_reward(scores_to_token_rewards(scores, mask), old, ref, mask,
                                              kl_coef=kl_coef, kind=algo.kl_penalty)
        metrics["critic/kl_in_reward"] = mean_kl
        metrics["critic/kl_in_reward_coef"] = kl_coef
        shaped = token_rewards.sum(-1)
        metrics.update({"critic/rewards/mean": float(shaped.mean()), "critic/rewards/max": float(shaped.max()),
                        "critic/rewards/min": float(shaped.min())})
        next_coef = next_kl_coef(algo.kl_ctrl_type, kl_coef, mean_kl, target_kl=algo.target_kl,
                                 horizon=algo.kl_horizon, n_steps=int(mask.shape[0]))
        if algo.adv_estimator == "reinforce_plus_plus":  # token-level returns of the shaped rewards
            return compute_reinforce_plus_plus_advantage(token_rewards, mask, gamma=algo.gamma), metrics, next_coef
        scores = token_rewards.sum(-1)
    advantages = compute_advantages(algo.adv_estimator, scores, group_index, mask,
                                    norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, gamma=algo.gamma)
    valid = mask.bool()
    metrics["critic/advantages/mean"] = float(advantages[valid].mean()) if valid.any() else 0.0
    metrics["critic/advantages/max"] = float(advantages[valid].max()) if valid.any() else 0.0
    metrics["critic/advantages/min"] = float(advantages[valid].min()) if valid.any() else 0.0
    return advantages, metrics, next_coef


def nonzero_advantage_metrics(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> dict[str, float]:
    """How many of the step's responses carry a learning signal: |advantage| > eps on some response token.

    A GRPO group whose rewards are all equal has advantage 0 everywhere (what `algorithm.filter_groups`
    keeps out of training). `eps` absorbs the rounding of a group mean of equal non-integer rewards.
    """
    nonzero = ((advantages.abs() > eps) & mask.bool()).any(dim=-1)
    return {"critic/nonzero_adv_frac": float(nonzero.float().mean()) if nonzero.numel() else 0.0,
            "critic/nonzero_adv_samples": float(nonzero.sum())}


def correction_inputs(
    old: torch.Tensor, rollout: Optional[torch.Tensor], mask: torch.Tensor, settings: RolloutCorrectionSettings,
    same_version: Optional[torch.Tensor] = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The loss mask (and `is_weights` when the correction is on) and the `mismatch/*` metrics.

    Without rollout log-probs (bypass mode: they ARE the old ones, so a mismatch of 0
    would be a number nobody measured) the loss mask is the response mask and there are
    no metrics. With them the correction's metrics are always reported; its weights and
    rejection mask enter the loss only when `settings.enable`. Computed over the whole
    batch at once, so `batch_normalize` is exact. The worker group calls this too, for a
    batch handed to `update()` without a loss mask: one definition.
    """
    if rollout is None:
        return {"loss_mask": mask.float()}, {}
    weights, kept, metrics = rollout_correction(old, rollout, mask, **settings.kwargs(), same_version=same_version)
    out = {f"mismatch/{k}": v for k, v in metrics.items()}
    if not settings.enable:
        return {"loss_mask": mask.float()}, out
    return {"loss_mask": kept.float(), "is_weights": weights.float()}, out


def update_input(batch: TensorDict, recomputed: bool) -> TensorDict:
    """The batch the worker group trains on: in bypass mode (`recomputed` false) without
    `rollout_log_probs`, which equal the old log-probs there (no mismatch to report)."""
    return batch if recomputed else batch.exclude("rollout_log_probs")


def prepare_batch(
    batch: TensorDict,
    algo: StepAlgorithm,
    group: LogProbSource,
    kl_coef: float,
    logprob_span: Callable[[], ContextManager] = contextlib.nullcontext,
    version: Optional[int] = None,
    local_updates: int = 0,
) -> tuple[dict[str, float], float]:
    """Adds `old_log_probs`, `ref_log_prob` (when used), `advantages`, `loss_mask` and
    `is_weights` (correction on) to the batch in place; returns (metrics, next KL coefficient).

    `logprob_span` wraps the old log-prob forward (the Trainer's timeline span); `version` is the
    last weight version the trainer pushed to the engines, which with the batch's `token_versions`
    splits the mismatch metrics. `local_updates` counts the optimizer steps the trainer took since
    that push (`trigger_parameter_sync_step > 1`): then its weights are ahead of every version a
    token can carry, and no token is of its version (tokens of `version` drifted by those steps).
    """
    mask = batch["response_mask"]
    metrics: dict[str, float] = {}
    rollout = batch["rollout_log_probs"]
    t0 = time.perf_counter()
    if algo.recompute_old_log_probs:
        with logprob_span():
            # entropy comes with the same forward (verl logs it from here too)
            old, entropy = group.compute_log_prob(batch, calculate_entropy=True)
        metrics["actor/entropy"] = _masked_mean(entropy, mask)
        same_version = None
        if version is not None and "token_versions" in batch.keys():
            same_version = same_version_tokens(batch["token_versions"], version, local_updates)
        metrics.update(mismatch_metrics(old, rollout, mask, same_version))
    else:
        old = rollout.clone()
        same_version = None
    batch["old_log_probs"] = old
    t1 = time.perf_counter()
    ref = None
    if algo.use_reference:
        ref = group.compute_ref_log_prob(batch)
        batch["ref_log_prob"] = ref
        metrics["actor/ref_kl_of_old"] = _masked_mean(kl_penalty(old, ref, "kl"), mask)
    t2 = time.perf_counter()
    advantages, adv_metrics, next_coef = step_advantages(algo, batch["scores"], batch["group_index"], mask, old, ref,
                                                         kl_coef)
    # verl's phase timings (old log-probs are 0 s in bypass mode: the rollout's are used)
    metrics.update({"timing_s/old_log_prob": t1 - t0, "timing_s/adv": time.perf_counter() - t2})
    if algo.use_reference:
        metrics["timing_s/ref"] = t2 - t1
    batch["advantages"] = advantages
    metrics.update(adv_metrics)
    metrics.update(nonzero_advantage_metrics(advantages, mask))
    tensors, correction_metrics = correction_inputs(old, rollout if algo.recompute_old_log_probs else None, mask,
                                                    algo.correction, same_version)
    batch.update(tensors)
    metrics.update(correction_metrics)  # after mismatch_metrics: the correction's values of shared keys win
    return metrics, next_coef
