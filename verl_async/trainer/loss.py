"""The actor's loss for one micro-batch, as its exact share of the mini-batch loss.

    loss = L_policy(w) - entropy_coeff * agg(H) + kl_loss_coef * agg(KL(pi || ref))

(verl's dp_actor terms; `L_policy` the `policy_loss.loss_mode` loss of verl_async.algos.policy_losses,
PPO clip by default, `w` the rollout-correction weights when enabled, `agg` the
`loss_agg_mode` aggregation). Every `agg` is taken with the MINI-BATCH's
denominators (valid tokens / non-empty sequences over all micro-batches and all DP
ranks; `seq-mean-token-sum-norm` divides by a constant horizon, verl's padded response
length `rollout.response_length`), so the micro-batch
losses add up to the mini-batch loss and their gradients to its gradient, whatever
the split (see verl_async.algos.losses). Metrics come back as shares too: summing
them over micro-batches and ranks gives the mini-batch value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from verl_async.algos import agg_loss, kl_penalty
from verl_async.algos.distillation import DistillationLoss, combine_with_policy_loss, distillation_loss, topk_log_probs
from verl_async.algos.policy_losses import compute_policy_loss

# the distillation metrics a micro-batch contributes (token-weighted shares, summed over micro-batches and ranks)
DISTILLATION_METRICS = ("distillation/loss", "distillation/abs_loss", "distillation/student_mass",
                        "distillation/teacher_mass")


@dataclass(frozen=True)
class LossConfig:
    loss_agg_mode: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    distillation: Optional[DistillationLoss] = None  # on-policy distillation (verl_async/algos/distillation.py)
    loss_mode: str = "vanilla"
    policy_loss: Mapping[str, Any] = field(default_factory=dict)  # the loss's own keys (besides the clip ratios)

    @classmethod
    def from_settings(cls, s) -> "LossConfig":
        """From a `TrainerSettings` (runtime overrides included)."""
        return cls(loss_agg_mode=s.loss_agg_mode, clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high,
                   clip_ratio_c=s.clip_ratio_c, entropy_coeff=s.entropy_coeff, use_kl_loss=s.use_kl_loss,
                   kl_loss_coef=s.kl_loss_coef, kl_loss_type=s.kl_loss_type, loss_mode=s.loss_mode,
                   policy_loss=dict(s.policy_loss), distillation=getattr(s, "distillation", None))

    def loss_params(self) -> dict[str, Any]:
        """Every key a policy loss may read; the clip ratios are this config's (they may change at runtime)."""
        return {**self.policy_loss, "clip_ratio_low": self.clip_ratio_low, "clip_ratio_high": self.clip_ratio_high,
                "clip_ratio_c": self.clip_ratio_c}


def loss_data_keys(distillation: Optional[DistillationLoss]) -> tuple[str, ...]:
    """The teacher tensors the distillation loss reads from the batch (the student's top-k come from the forward)."""
    if distillation is None:
        return ()
    return ("teacher_topk_ids", "teacher_topk_log_probs") if distillation.uses_topk else ("teacher_log_probs",)


def actor_loss(logp: torch.Tensor, entropy: Optional[torch.Tensor], data: Mapping[str, torch.Tensor],
               cfg: LossConfig, *, global_tokens: float, global_seqs: float,
               loss_scale_factor: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Micro-batch share of the loss and metric shares.

    `data` holds [b, T] tensors: `loss_mask`, `old_log_probs`, `advantages`, optional
    `is_weights` (rollout correction) and `ref_log_prob` (when `use_kl_loss`).
    """
    mask = data["loss_mask"]
    norm = dict(global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    pg_loss, pg_metrics = compute_policy_loss(
        cfg.loss_mode, logp, data["old_log_probs"], data["advantages"], mask, params=cfg.loss_params(),
        loss_agg_mode=cfg.loss_agg_mode, is_weights=data.get("is_weights"), **norm,
    )
    # the losses' ratio metrics are token means over this micro-batch: weight them by its token share
    # (a loss without a clip reports none: 0).
    share = float(mask.sum()) / max(global_tokens, 1.0)
    metrics = {
        "actor/pg_loss": float(pg_loss.detach()),
        "actor/pg_clipfrac": pg_metrics.get("pg_clipfrac", 0.0) * share,
        "actor/pg_clipfrac_lower": pg_metrics.get("pg_clipfrac_lower", 0.0) * share,
        "actor/ppo_kl": pg_metrics.get("ppo_kl", 0.0) * share,
    }
    loss = pg_loss
    if entropy is not None:
        ent = agg_loss(entropy if cfg.entropy_coeff != 0 else entropy.detach(), mask, cfg.loss_agg_mode, **norm)
        metrics["actor/entropy"] = float(ent.detach())
        if cfg.entropy_coeff != 0:
            loss = loss - cfg.entropy_coeff * ent
    if cfg.use_kl_loss:
        kld = kl_penalty(logp, data["ref_log_prob"], cfg.kl_loss_type)
        kl = agg_loss(kld, mask, cfg.loss_agg_mode, **norm)
        metrics["actor/kl_loss"] = float(kl.detach())
        loss = loss + cfg.kl_loss_coef * kl
    if cfg.distillation is not None:
        distill, dm = distillation_loss(
            cfg.distillation, logp, data["old_log_probs"], mask, cfg.loss_agg_mode,
            teacher_logp=data.get("teacher_log_probs"), student_topk_logp=data.get("student_topk_log_probs"),
            teacher_topk_logp=data.get("teacher_topk_log_probs"), is_weights=data.get("is_weights"), **norm)
        metrics["distillation/loss"] = float(distill.detach())
        for name in ("abs_loss", "student_mass", "teacher_mass"):  # token means over this micro-batch
            if name in dm:
                metrics[f"distillation/{name}"] = dm[name] * share
        loss = combine_with_policy_loss(cfg.distillation, loss, distill)
    metrics["actor/loss"] = float(loss.detach())
    return loss, metrics


def guarded_actor_loss(logp: torch.Tensor, entropy: Optional[torch.Tensor], data: Mapping[str, torch.Tensor],
                       cfg: LossConfig, *, rows: Sequence[int], global_tokens: float, global_seqs: float,
                       loss_scale_factor: int) -> tuple[Optional[torch.Tensor], dict[str, float], Optional[str]]:
    """`actor_loss`, or (None, {}, reason) when log-probs / entropy / loss are not finite at valid tokens.

    The caller then skips the optimizer step on every rank (the reason goes to the metrics).
    """
    valid = data["loss_mask"].bool()
    finite = torch.isfinite(logp) & (torch.isfinite(entropy) if entropy is not None else True)
    for name in ("student_topk_log_probs", "teacher_topk_log_probs", "teacher_log_probs"):
        if name in data:  # a teacher's or the student's top-k: every entry of a valid token
            values = data[name]
            finite = finite & (torch.isfinite(values).all(-1) if values.ndim == 3 else torch.isfinite(values))
    if not bool(finite[valid].all()):
        return None, {}, f"non-finite log-probs/entropy in rows {list(rows)[:8]}"
    try:
        loss, metrics = actor_loss(logp, entropy, data, cfg, global_tokens=global_tokens, global_seqs=global_seqs,
                                   loss_scale_factor=loss_scale_factor)
    except ValueError as exc:  # non-finite per-token loss
        return None, {}, str(exc)
    return loss, metrics, None


def student_topk(logits: torch.Tensor, inp, topk_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """The student's log-probs (temperature applied, as its sampled-token ones) of a teacher's top-k tokens,
    `[b, T, K]` for a micro-batch's `ModelInputs` (`logits` [r, K', V] at its kept positions; 0 off the response)."""
    flat = logits.reshape(-1, logits.shape[-1])[inp.src]  # one row per valid response token
    values = topk_log_probs(flat, topk_ids[inp.dst_row, inp.dst_col], temperature)
    out = values.new_zeros((inp.num_rows, inp.width, topk_ids.shape[-1]))
    return out.index_put((inp.dst_row, inp.dst_col), values)
