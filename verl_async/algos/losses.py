"""Loss aggregation and the PPO clipped policy loss (verl semantics).

Aggregation (`loss_agg_mode`), with `L` the per-token loss, `M` the 0/1 mask,
`s` the sequences with at least one valid token (empty rows never count):

  token-mean               sum(L*M) / sum(M)
  token-sum                sum(L*M)  (no denominator: verl 0.9's sum over the batch's valid tokens)
  seq-mean-token-sum       sum_s sum_t(L*M) / |s|
  seq-mean-token-mean      sum_s [sum_t(L*M) / sum_t M] / |s|
  seq-mean-token-sum-norm  sum_s sum_t(L*M) / |s| / H,  H = loss_scale_factor, default T = mask.shape[-1]

(the current verl `core_algos.agg_loss`, including its division by the sequence
count in the `-norm` mode; Dr.GRPO wants H constant over training: pass
`loss_scale_factor`, e.g. the max response length).

Gradient accumulation. The full-batch loss is a sum over tokens or sequences
divided by a batch-wide count. A micro-batch therefore contributes its own sum
divided by the *global* count:

    norm = global_batch_info([mb.mask for mb in micro_batches])   # counts of the whole batch
    for mb in micro_batches:
        agg_loss(mb.loss, mb.mask, mode, **norm).backward()          # grads add up

so that sum over micro-batches of the micro losses == the full-batch loss, and
the accumulated gradient == the full-batch gradient, for every mode. Across DP
ranks: all-reduce SUM `global_tokens`/`global_seqs` and MAX `loss_scale_factor`
before the loop; then the sum over ranks and micro-batches equals the full loss.
FSDP/DDP *average* gradients over ranks, so multiply each micro loss by the DP
world size before backward (verl's `dp_size` factor) to keep that sum.
A sequence must not be split across micro-batches (packing never splits one).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._checks import check_choice, check_finite, check_mask, check_same_shape, check_tensor, masked_mean

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def global_batch_info(masks: torch.Tensor | Sequence[torch.Tensor]) -> dict[str, int]:
    """Batch-wide denominators for `agg_loss` from the masks of all micro-batches.

    Returns `{"global_tokens", "global_seqs", "loss_scale_factor"}`: valid tokens,
    non-empty sequences, and the widest mask (T) — splat into `agg_loss(...)`.
    """
    if isinstance(masks, torch.Tensor):
        masks = [masks]
    if len(masks) == 0:
        raise ValueError("masks: give at least one micro-batch mask")
    tokens = seqs = horizon = 0
    for i, m in enumerate(masks):
        check_tensor(f"masks[{i}]", m, ndim=2)
        b = check_mask(f"masks[{i}]", m)
        tokens += int(b.sum())
        seqs += int(b.any(-1).sum())
        horizon = max(horizon, b.shape[-1])
    return {"global_tokens": tokens, "global_seqs": seqs, "loss_scale_factor": horizon}


def _denominator(value: int | float | torch.Tensor | None, local: torch.Tensor, name: str) -> torch.Tensor:
    if value is None:
        return local
    den = torch.as_tensor(value, dtype=local.dtype, device=local.device)
    if den.dim() != 0 or not bool(torch.isfinite(den)) or bool(den < 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return den


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> torch.Tensor:
    """Reduce a `[B, T]` per-token loss to a scalar (formulas in the module docstring).

    Without `global_*` the denominators are this batch's own counts. With them, the
    result is this micro-batch's share of the global loss (see the module
    docstring). A zero denominator (all-zero mask) gives 0 with zero gradient.
    Values under the mask must be finite; values outside it are ignored (even NaN).
    """
    check_tensor("loss_mat", loss_mat, ndim=2)
    check_same_shape("loss_mat", loss_mat, mask=mask)
    check_choice("loss_agg_mode", mode, LOSS_AGG_MODES)
    valid = check_mask("mask", mask)
    check_finite("loss_mat", loss_mat, valid)
    if loss_scale_factor is not None and not loss_scale_factor > 0:
        raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor!r}")
    dtype = loss_mat.dtype if loss_mat.is_floating_point() else torch.float32
    zero = torch.zeros((), dtype=dtype, device=loss_mat.device)
    masked = torch.where(valid, loss_mat.to(dtype), zero)
    if mode == "token-mean":
        den = _denominator(global_tokens, valid.sum().to(dtype), "global_tokens")
        return masked.sum() / den.clamp(min=1)
    if mode == "token-sum":
        return masked.sum()
    seq_sum = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        seq_sum = seq_sum / valid.sum(-1).to(dtype).clamp(min=1)
    den = _denominator(global_seqs, valid.any(-1).sum().to(dtype), "global_seqs")
    loss = seq_sum.sum() / den.clamp(min=1)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor if loss_scale_factor is not None else mask.shape[-1])
    return loss


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual clip (verl's `compute_policy_loss_vanilla`).

    ratio = exp(clamp(logp - old, -20, 20));
    L = max(-A*ratio, -A*clip(ratio, 1-low, 1+high)); for A < 0 additionally
    L = min(L, -A*clip_ratio_c) (dual clip; `clip_ratio_c=None` turns it off).
    `is_weights` (e.g. rollout-correction weights) multiply L per token, as constants,
    before `agg_loss(L, mask, loss_agg_mode, global_*...)`.

    Metrics (python floats, masked means over this batch): `pg_clipfrac` (tokens where
    the clipped branch is active), `pg_clipfrac_lower` (dual clip active), `ppo_kl`
    (mean of old - logp), `pg_loss`.
    """
    check_tensor("logp", logp, ndim=2)
    check_same_shape("logp", logp, old_logp=old_logp, advantages=advantages, mask=mask, is_weights=is_weights)
    valid = check_mask("mask", mask)
    check_finite("logp", logp, valid)
    check_finite("old_logp", old_logp, valid)
    check_finite("advantages", advantages, valid)
    if is_weights is not None:
        check_finite("is_weights", is_weights, valid)
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip_ratio_low/high must be >= 0, got {clip_ratio_low}/{clip_ratio_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (dual-clip lower bound), got {clip_ratio_c}")

    # Padding may hold anything (even NaN): zero it so no NaN reaches the gradient.
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp, old_logp, advantages = (torch.where(valid, x, zero) for x in (logp, old_logp, advantages))
    neg_kl = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    pg_losses = clipped
    lower_frac = torch.zeros((), device=logp.device)
    if clip_ratio_c is not None:
        loss3 = -advantages * clip_ratio_c
        negative = advantages < 0
        pg_losses = torch.where(negative, torch.minimum(clipped, loss3), clipped)
        lower_frac = masked_mean(((clipped > loss3) & negative).float(), valid)
    if is_weights is not None:
        pg_losses = pg_losses * is_weights.detach()
    loss = agg_loss(
        pg_losses,
        valid,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        metrics = {
            "pg_loss": float(loss.detach()),
            "pg_clipfrac": float(masked_mean((loss2 > loss1).float(), valid)),
            "pg_clipfrac_lower": float(lower_frac),
            "ppo_kl": float(masked_mean(-neg_kl, valid)),
        }
    return loss, metrics


def ratio_deviation_max(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """max |ratio - 1| over the masked tokens, ratio = exp(clamp(logp - old, -20, 20)) as in `ppo_policy_loss`;
    inf when a masked token's log-prob is not finite, 0.0 for an empty mask.

    0.0 means the PPO ratio is exactly 1 at every token: the loss's forward reproduced the old log-probs
    bit for bit (true on-policy mode's check at the first mini-batch of a step)."""
    valid = mask.bool()
    if not bool(valid.any()):
        return 0.0
    diff = (logp - old_logp)[valid]
    if not bool(torch.isfinite(diff).all()):
        return float("inf")
    return float((torch.exp(diff.clamp(-20.0, 20.0)) - 1.0).abs().max())
