"""Rollout correction for the train/inference mismatch (slime TIS/MIS semantics).

The rollout engine's log-probs (behaviour policy) differ slightly from the
trainer's recomputed old log-probs (proximal policy). Importance weights
`w = pi_old / pi_rollout` correct the policy gradient for it; rejection
(masking), veto and batch self-normalisation keep the weights from exploding.
See shared/reference/004 (slime's mismatch blog) for the bias/variance story.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_choice, check_finite, check_mask, check_same_shape, check_tensor, masked_mean

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "clip", "mask")
# old_prob: slime's rule (docs/architecture.md "Rollout correction"): a token the old policy itself finds almost impossible.
# ratio: verl's rollout_token_veto_threshold: a token whose weight pi_old / pi_rollout is tiny.
VETO_RULES = ("old_prob", "ratio")


def _level_log_ratio(r: torch.Tensor, valid: torch.Tensor, level: str) -> torch.Tensor:
    """Per-token log-ratio `r` (0 on padding) lifted to `level`, broadcast to `[B, T]`."""
    if level == "token":
        return r
    seq = r.sum(-1, keepdim=True)
    if level == "geometric":
        seq = seq / valid.sum(-1, keepdim=True).clamp(min=1).to(r.dtype)
    return seq.expand_as(r)


def vetoed_sequences(
    old_logp: torch.Tensor, log_ratio: torch.Tensor, valid: torch.Tensor, threshold: float, rule: str = "old_prob"
) -> torch.Tensor:
    """`[B]` bool: sequences holding a valid token below `threshold`.

    `old_prob` (the default, slime's rule): `pi_old(token) < threshold`, i.e. `old_logp <
    log(threshold)`; such a token makes any ratio with it in the denominator unstable.
    `ratio` (verl): `pi_old / pi_rollout < threshold`, i.e. `log_ratio < log(threshold)`.
    Padding (`valid` false) never vetoes.
    """
    check_choice("veto_rule", rule, VETO_RULES)
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"veto_threshold must be in (0, 1], got {threshold!r}")
    x = old_logp if rule == "old_prob" else log_ratio
    return (valid & (x < math.log(threshold))).any(-1)


def _bounds(lower: float | None, upper: float | None, what: str) -> tuple[float, float]:
    hi = math.inf if upper is None else float(upper)
    if not hi > 0:
        raise ValueError(f"{what} upper bound must be > 0, got {upper!r}")
    lo = (1.0 / hi if math.isfinite(hi) else 0.0) if lower is None else float(lower)
    if not 0.0 <= lo <= hi:
        raise ValueError(f"{what} bounds must satisfy 0 <= lower <= upper, got lower={lo}, upper={hi}")
    return lo, hi


def _same_version_units(same: torch.Tensor, valid: torch.Tensor, level: str) -> torch.Tensor:
    """[B, T]: valid tokens whose unit at `level` holds only same-version tokens."""
    if level == "token":
        return same
    return valid & (same | ~valid).all(-1, keepdim=True)


def _same_version_metrics(w: torch.Tensor, rejected: torch.Tensor, valid: torch.Tensor, same_version: torch.Tensor,
                          level: str, rs_level: str) -> dict[str, float]:
    check_same_shape("same_version", same_version, w=w)
    same = valid & same_version.to(torch.bool)
    out: dict[str, float] = {}
    weighted = _same_version_units(same, valid, level)
    if weighted.any():
        out["same_version_weight_dev_max"] = float((w[weighted] - 1.0).abs().max())
    tested = weighted & _same_version_units(same, valid, rs_level)
    if tested.any():
        out["same_version_rejected_frac"] = float(rejected[tested].float().mean())
    return out


@torch.no_grad()
def rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    lower: float | None = None,
    upper: float | None = 2.0,
    rs: bool = False,
    rs_level: str | None = None,
    rs_lower: float | None = None,
    rs_upper: float | None = None,
    veto_threshold: float | None = None,
    veto_rule: str = "old_prob",
    batch_normalize: bool = False,
    same_version: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Importance weights, corrected loss mask and mismatch metrics.

    `r = old_logp - rollout_logp` per valid token. Level: `token` (r),
    `sequence` (sum of r over the sequence: product of token ratios), `geometric`
    (mean of r: geometric mean). `w = exp(clamp(r_level, -20, 20))`, then mode:
    `truncate` w = min(w, upper); `clip` w = clamp(w, lower, upper); `mask` keeps w
    but drops tokens whose w is outside [lower, upper] from the mask. `lower`
    defaults to 1/upper; `upper=None` means no upper bound.

    `rs=True` (rejection sampling) drops, from the mask, tokens whose weight at
    `rs_level` (default `level`) lies outside [rs_lower, rs_upper] (default: the IS
    bounds); at sequence/geometric level that is the whole sequence. `veto_threshold`
    drops every sequence holding a valid token whose old-policy probability is below
    it (`veto_rule="old_prob"`, slime) or, with `veto_rule="ratio"` (verl), whose
    ratio `pi_old / pi_rollout` is below it; see `vetoed_sequences`.
    `batch_normalize` divides the weights by their mean over kept tokens (token
    level) or kept sequences (sequence level); it refuses the geometric level.

    `same_version` ([B, T] bool, optional): the tokens sampled by the very weights that recomputed
    `old_logp` (no policy drift). Then `same_version_weight_dev_max` (max |w - 1| before
    `batch_normalize`) and `same_version_rejected_frac` (share removed by `mask` mode or `rs`) are
    measured over the units that hold only such tokens (a token at token level, a sequence at
    sequence/geometric level): with bitwise-equal log-probs (true on-policy mode) both are 0.0,
    so every weight != 1 and every rejection comes from stale tokens. (The `old_prob` veto is
    not a mismatch test: a same-version token below its threshold is still vetoed.)

    Returns `(weights, mask, metrics)`: weights `[B, T]` (constants, 0 on padding;
    rejected tokens keep their weight, the mask removes them), the corrected mask in
    the input mask's dtype (use it as the loss mask), and float metrics.
    """
    check_tensor("old_logp", old_logp, ndim=2)
    check_same_shape("old_logp", old_logp, rollout_logp=rollout_logp, mask=mask)
    check_choice("level", level, LEVELS)
    check_choice("mode", mode, MODES)
    rs_level = level if rs_level is None else check_choice("rs_level", rs_level, LEVELS)
    check_choice("veto_rule", veto_rule, VETO_RULES)
    if batch_normalize and level == "geometric":
        raise ValueError("batch_normalize is not defined for level='geometric'; use level 'token' or 'sequence'")
    if veto_threshold is not None and not 0.0 < veto_threshold <= 1.0:
        raise ValueError(f"veto_threshold must be in (0, 1], got {veto_threshold!r}")
    lo, hi = _bounds(lower, upper, "IS")
    rs_lo, rs_hi = _bounds(rs_lower if rs_lower is not None else lo, rs_upper if rs_upper is not None else hi, "RS")
    valid = check_mask("mask", mask)
    check_finite("old_logp", old_logp, valid)
    check_finite("rollout_logp", rollout_logp, valid)

    dtype = torch.promote_types(old_logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old_logp.device)
    old = torch.where(valid, old_logp.detach().to(dtype), zero)
    rollout = torch.where(valid, rollout_logp.detach().to(dtype), zero)
    r = old - rollout
    keep = valid.clone()
    metrics: dict[str, float] = {}

    w = torch.exp(torch.clamp(_level_log_ratio(r, valid, level), -20.0, 20.0))
    if mode == "truncate":
        metrics["truncate_frac"] = float(masked_mean((w > hi).to(dtype), valid))
        w = torch.clamp(w, max=hi)
    elif mode == "clip":
        metrics["clip_frac"] = float(masked_mean(((w < lo) | (w > hi)).to(dtype), valid))
        w = torch.clamp(w, min=lo, max=hi)
    else:
        outside = valid & ((w < lo) | (w > hi))
        metrics["mask_frac"] = float(masked_mean(outside.to(dtype), valid))
        keep &= ~outside

    if rs:
        w_rs = torch.exp(torch.clamp(_level_log_ratio(r, valid, rs_level), -20.0, 20.0))
        rejected = valid & ((w_rs < rs_lo) | (w_rs > rs_hi))
        metrics["rs_frac"] = float(masked_mean(rejected.to(dtype), valid))
        keep &= ~rejected

    if same_version is not None:
        metrics.update(_same_version_metrics(w, valid & ~keep, valid, same_version, level, rs_level if rs else level))

    nonempty = valid.any(-1)
    num_seqs = int(nonempty.sum())
    if veto_threshold is not None:
        vetoed = vetoed_sequences(old, r, valid, veto_threshold, veto_rule)
        metrics["veto_frac"] = float(vetoed.sum()) / max(num_seqs, 1)
        keep &= ~vetoed[:, None]

    if batch_normalize:
        if level == "token":
            norm = w[keep].mean() if bool(keep.any()) else None
        else:  # sequence: one weight per kept sequence
            kept_seq = keep.any(-1)
            norm = w[:, 0][kept_seq].mean() if bool(kept_seq.any()) else None
        if norm is not None:
            w = w / norm

    weights = torch.where(valid, w, zero)
    kept_w = w[keep]
    seq_len = valid.sum(-1).clamp(min=1).to(dtype)
    r_prime = torch.clamp(-r, -20.0, 20.0)  # rollout - old

    def seq_ppl(lp: torch.Tensor) -> float:  # mean over sequences of exp(-mean token log-prob)
        return float(torch.exp(-lp.sum(-1) / seq_len)[nonempty].mean()) if num_seqs else 0.0

    metrics.update(
        {
            "train_rollout_logprob_abs_diff": float(masked_mean(r.abs(), valid)),
            "k3_kl": float(masked_mean(torch.exp(r_prime) - r_prime - 1.0, valid)),
            "kl": float(masked_mean(-r, valid)),
            "training_ppl": seq_ppl(old),
            "rollout_ppl": seq_ppl(rollout),
            "rejected_token_frac": 1.0 - float(keep.sum()) / max(int(valid.sum()), 1),
            "weight_mean": float(kept_w.mean()) if kept_w.numel() else 0.0,
            "weight_min": float(kept_w.min()) if kept_w.numel() else 0.0,
            "weight_max": float(kept_w.max()) if kept_w.numel() else 0.0,
        }
    )
    return weights, keep.to(mask.dtype), metrics
