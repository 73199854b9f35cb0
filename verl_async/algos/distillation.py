"""On-policy distillation losses (verl's `verl/trainer/distillation/`): the student learns the teachers' token
distribution on its own samples.

Per response token, with s = the student's log-prob (temperature applied, as every trainer log-prob) and
t = the teacher's (temperature 1, a forward pass over prompt + response):

* estimator modes (`kl|k1, abs, mse|k2, low_var_kl|k3`): `kl_penalty(s, t, mode)` of the sampled token
  (verl's `compute_distillation_loss_reverse_kl_estimator`: a single-sample estimate of KL(student || teacher));
* `forward_kl_topk`: sum over the teacher's top-k tokens v of p_t(v) (log p_t(v) - log p_s(v)), both log-probs
  clamped from below at `log_prob_min_clamp` first, the result clamped at 0 (top-k masses do not sum to 1).

Then (verl's `distillation_loss`): the per-token loss is clamped to [-loss_max_clamp, loss_max_clamp]; with
`use_policy_gradient` it becomes the advantage of a PPO term, A = -loss (detached), vanilla clip with the
distillation's clip ratios and clip_ratio_c = 3; otherwise it is aggregated directly (`agg_loss`, the actor's
loss_agg_mode). The actor's loss is then (verl's `distillation_ppo_loss`):

    loss = [policy loss if use_task_rewards] + (distillation_loss_coef if use_task_rewards else 1) x distillation

Masks: every term takes the loss mask (padding and multi-turn tool tokens are 0), like every other loss.
"""

from __future__ import annotations

from typing import Optional

import torch

from verl_async.distillation_loss import ESTIMATOR_MODES, TOPK_MODES, DistillationLoss  # noqa: F401 - re-exported

from .kl import kl_penalty
from .losses import agg_loss, ppo_policy_loss

DISTILLATION_CLIP_RATIO_C = 3.0  # verl's vanilla loss reads clip_ratio_c from a config that has none: its default


def topk_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                   chunk: int = 4096) -> torch.Tensor:
    """log_softmax(logits / temperature)[ids] in float32, `[N, V]` logits and `[N, K]` ids -> `[N, K]`, in chunks of
    `chunk` rows (never the whole `[N, V]` log-softmax at once; verl's `_chunked_topk_log_probs`)."""
    if logits.ndim != 2 or ids.ndim != 2 or logits.shape[0] != ids.shape[0]:
        raise ValueError(f"topk_log_probs: logits [N, V] and ids [N, K], got {tuple(logits.shape)} and "
                         f"{tuple(ids.shape)}")
    out = logits.new_empty(ids.shape, dtype=torch.float32)
    scale = 1.0 if not temperature else float(temperature)
    for start in range(0, logits.shape[0], chunk):
        rows = logits[start:start + chunk].float() / scale
        out[start:start + chunk] = rows.gather(-1, ids[start:start + chunk].long()) - torch.logsumexp(rows, -1,
                                                                                                        keepdim=True)
    return out


def forward_kl_topk(student_topk_logp: torch.Tensor, teacher_topk_logp: torch.Tensor,
                    log_prob_min_clamp: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token forward KL over the teacher's top-k, `[..., K]` -> `[...]`: (loss, student mass, teacher mass).

    The masses are taken before the clamp (verl logs them so); the loss is clamped at 0."""
    if student_topk_logp.shape != teacher_topk_logp.shape:
        raise ValueError(f"forward_kl_topk: student {tuple(student_topk_logp.shape)} and teacher "
                         f"{tuple(teacher_topk_logp.shape)} top-k log-probs differ in shape")
    student, teacher = student_topk_logp.float(), teacher_topk_logp.float()
    student_mass, teacher_mass = student.exp().sum(-1), teacher.exp().sum(-1)
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    loss = (teacher.exp() * (teacher - student)).sum(-1)
    return loss.clamp_min(0.0), student_mass, teacher_mass


def distillation_token_losses(cfg: DistillationLoss, logp: torch.Tensor, *,
                              teacher_logp: Optional[torch.Tensor] = None,
                              student_topk_logp: Optional[torch.Tensor] = None,
                              teacher_topk_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """The `[B, T]` per-token distillation loss before the max clamp, and its top-k masses (top-k modes)."""
    if cfg.uses_topk:
        if student_topk_logp is None or teacher_topk_logp is None:
            raise ValueError("forward_kl_topk needs the student's and the teacher's top-k log-probs")
        loss, student_mass, teacher_mass = forward_kl_topk(student_topk_logp, teacher_topk_logp,
                                                           cfg.log_prob_min_clamp)
        return loss, {"student_mass": student_mass, "teacher_mass": teacher_mass}
    if teacher_logp is None:
        raise ValueError(f"distillation loss_mode={cfg.loss_mode} needs the teacher's log-prob of each sampled token")
    return kl_penalty(logp, teacher_logp, cfg.loss_mode), {}


def distillation_loss(cfg: DistillationLoss, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                      loss_agg_mode: str, *, teacher_logp: Optional[torch.Tensor] = None,
                      student_topk_logp: Optional[torch.Tensor] = None,
                      teacher_topk_logp: Optional[torch.Tensor] = None, is_weights: Optional[torch.Tensor] = None,
                      global_tokens=None, global_seqs=None, loss_scale_factor=None) -> tuple[torch.Tensor, dict]:
    """The aggregated distillation loss (module docstring) and its metrics (python floats over this batch:
    `loss_min`/`loss_max` over valid tokens before the clamp, `abs_loss` or the top-k masses)."""
    losses, extra = distillation_token_losses(cfg, logp, teacher_logp=teacher_logp,
                                              student_topk_logp=student_topk_logp, teacher_topk_logp=teacher_topk_logp)
    valid = mask.bool()
    # padding may hold anything (teacher log-probs are 0 there): only valid tokens reach the loss or the metrics
    losses = torch.where(valid, losses, torch.zeros_like(losses))
    metrics: dict[str, float] = {}
    if valid.any():
        metrics["loss_min"], metrics["loss_max"] = float(losses[valid].min()), float(losses[valid].max())
        if cfg.uses_topk:
            metrics.update({k: float(v[valid].mean()) for k, v in extra.items()})
        else:
            metrics["abs_loss"] = float(losses[valid].abs().mean())
    if cfg.loss_max_clamp is not None:  # the min side is for k1, which can be negative
        losses = losses.clamp(min=-cfg.loss_max_clamp, max=cfg.loss_max_clamp)
    norm = dict(global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    if cfg.use_policy_gradient:  # -loss as the advantage (thinkingmachines.ai/blog/on-policy-distillation)
        loss, pg = ppo_policy_loss(logp, old_logp, -losses.detach(), mask, clip_ratio_low=cfg.clip_ratio_low,
                                   clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=DISTILLATION_CLIP_RATIO_C,
                                   loss_agg_mode=loss_agg_mode, is_weights=is_weights, **norm)
        metrics.update({f"pg_{k}" if not k.startswith("pg_") else k: v for k, v in pg.items() if k != "pg_loss"})
        return loss, metrics
    return agg_loss(losses, mask, loss_agg_mode, **norm), metrics


def combine_with_policy_loss(cfg: DistillationLoss, policy_loss: torch.Tensor,
                             distill: torch.Tensor) -> torch.Tensor:
    """verl's `distillation_ppo_loss`: the task-reward policy loss counts only with use_task_rewards."""
    if cfg.use_task_rewards:
        return policy_loss + cfg.distillation_loss_coef * distill
    return distill
