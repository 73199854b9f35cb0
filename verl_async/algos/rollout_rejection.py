"""verl 0.9's rollout-correction statistics: IS weights (TIS / IcePop) and divergence rejection.

verl's `algorithm.rollout_correction` spells a correction as `rollout_is` (token | sequence)
with `rollout_is_threshold` (a number u: truncate at u; "lower_upper": IcePop, zero the
weights outside) and `rollout_rs`, comma-separated rejection options with
`rollout_rs_threshold` (one spec, or one per option):

  token_k1, seq_sum_k1, seq_mean_k1          k1 = -log r, kept within [log lower, log upper]
                                             (a single number u means [1/u, u])
  token_k2, seq_sum_k2, seq_mean_k2, seq_max_k2   k2 = (log r)^2 / 2, kept <= upper
  token_k3, seq_sum_k3, seq_mean_k3, seq_max_k3   k3 = r - 1 - log r, kept <= upper

with `log r = log pi_train - log pi_rollout` clamped to [-20, 20]; a sequence option keeps or
drops whole sequences. Every option must pass. The bypass-mode policy loss
(`policy_losses.bypass_mode`) applies these per micro-batch with `pi_train` the policy being
trained, as verl's `compute_policy_loss_bypass_mode` does.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from ._checks import check_choice, check_mask, check_same_shape, check_tensor

SAFETY_BOUND = 20.0
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
IS_LEVELS = ("token", "sequence")


class Criterion(NamedTuple):
    option: str  # one of RS_OPTIONS
    lower: Optional[float]  # k1 only: the lower ratio bound
    upper: float  # k1: the upper ratio bound; k2/k3: the largest divergence kept


def _positive(spec: str, option: str) -> float:
    try:
        value = float(spec)
    except ValueError:
        raise ValueError(f"rollout_rs_threshold: {spec!r} for {option} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"rollout_rs_threshold: {spec!r} for {option} must be a positive number")
    return value


def parse_rejection(rollout_rs: str, threshold: object) -> list[Criterion]:
    """verl's `rollout_rs` and `rollout_rs_threshold` as criteria (ValueError naming the bad part)."""
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    if not options:
        raise ValueError("rollout_rs: no option given")
    for option in options:
        if option not in RS_OPTIONS:
            raise ValueError(f"rollout_rs: unknown option {option!r}; expected one of: {', '.join(RS_OPTIONS)}")
    if threshold is None:
        raise ValueError(f"rollout_rs_threshold: must be set when rollout_rs={rollout_rs}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError(f"rollout_rs_threshold: expected a number or a string, got {threshold!r}")
    specs = [str(threshold)] if isinstance(threshold, (int, float)) else [
        p.strip() for p in threshold.split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold: {len(specs)} values for {len(options)} options; give one, or one "
                         "per option")
    specs = specs * len(options) if len(specs) == 1 else specs
    out = []
    for option, spec in zip(options, specs):
        if option.endswith("k1"):
            low, sep, high = spec.partition("_")
            upper = _positive(high if sep else low, option)
            lower = _positive(low, option) if sep else 1.0 / upper
            if lower > upper:
                raise ValueError(f"rollout_rs_threshold: lower bound {lower:g} > upper bound {upper:g} for {option}")
            out.append(Criterion(option, lower, upper))
        else:
            if "_" in spec:
                raise ValueError(f"rollout_rs_threshold: {option} takes one upper bound, got {spec!r}")
            out.append(Criterion(option, None, _positive(spec, option)))
    return out


def parse_is_threshold(threshold: object) -> tuple[Optional[float], float]:
    """verl's `rollout_is_threshold`: a number u -> (None, u) (truncate); "lower_upper" -> IcePop bounds."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError(f"rollout_is_threshold: expected a number or 'lower_upper', got {threshold!r}")
    spec = str(threshold).strip()
    low, sep, high = spec.partition("_")
    try:
        upper = float(high if sep else low)
        lower = float(low) if sep else None
    except ValueError:
        raise ValueError(f"rollout_is_threshold: {threshold!r} is not a number or 'lower_upper'") from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold: bounds must be positive with lower <= upper, got {threshold!r}")
    return lower, upper


def _seq(values: torch.Tensor, valid: torch.Tensor, how: str) -> torch.Tensor:
    """A per-token statistic reduced per sequence (sum, mean or max over valid tokens)."""
    if how == "max":
        top = values.masked_fill(~valid, float("-inf")).max(dim=-1).values
        return torch.where(torch.isinf(top), torch.zeros_like(top), top)
    total = torch.where(valid, values, torch.zeros_like(values)).sum(-1)
    return total if how == "sum" else total / (valid.sum(-1).to(values.dtype) + 1e-8)


@torch.no_grad()
def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, criteria: Sequence[Criterion]
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """`mask` with the tokens (or sequences) outside any criterion zeroed, and the fractions dropped.

    `log_ratio` is `log pi_train - log pi_rollout` per token ([B, T]); padding never counts.
    """
    check_tensor("log_ratio", log_ratio, ndim=2)
    check_same_shape("log_ratio", log_ratio, mask=mask)
    valid = check_mask("mask", mask)
    lr = torch.clamp(torch.where(valid, log_ratio, torch.zeros_like(log_ratio)), -SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}
    keep = torch.ones_like(valid)
    for c in criteria:
        check_choice("rollout_rs option", c.option, RS_OPTIONS)
        kind = c.option[-2:]
        stat = stats[kind]
        if not c.option.startswith("token"):
            stat = _seq(stat, valid, c.option.split("_")[1])[:, None].expand_as(lr)
        if kind == "k1":
            ok = (stat >= math.log(c.lower)) & (stat <= math.log(c.upper))
        else:
            ok = stat <= c.upper
        keep &= ok
    dropped = valid & ~keep
    n_valid = max(int(valid.sum()), 1)
    seqs = max(int(valid.any(-1).sum()), 1)
    metrics = {"rollout_rs_masked_fraction": float(dropped.sum()) / n_valid,
               "rollout_rs_seq_masked_fraction": float(dropped.any(-1).sum()) / seqs}
    return (mask * keep.to(mask.dtype)) if mask.dtype != torch.bool else (mask & keep), metrics


@torch.no_grad()
def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, lower: Optional[float], upper: float,
               batch_normalize: bool = False) -> torch.Tensor:
    """verl's rollout IS weights: `exp(log r)` per token or per sequence (sum of log r), clamped to +-20 in
    log space, 0 on padding; truncated at `upper` (TIS) or, with `lower`, zeroed outside [lower, upper]
    (IcePop); `batch_normalize` divides by their mean over valid tokens (token) or sequences (sequence)."""
    check_tensor("log_ratio", log_ratio, ndim=2)
    check_same_shape("log_ratio", log_ratio, mask=mask)
    check_choice("rollout_is", level, IS_LEVELS)
    valid = check_mask("mask", mask)
    m = valid.to(log_ratio.dtype)
    lr = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))
    if level == "sequence":
        lr = lr.sum(-1, keepdim=True).expand_as(lr)
    raw = torch.exp(torch.clamp(lr, -SAFETY_BOUND, SAFETY_BOUND)) * m
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    if batch_normalize:
        if level == "token":
            mean = (w * m).sum() / (m.sum() + 1e-8)
        else:
            seq_w = (w * m).sum(-1) / (m.sum(-1) + 1e-8)
            seq_m = valid.any(-1).to(w.dtype)
            mean = (seq_w * seq_m).sum() / seq_m.sum().clamp(min=1e-8)
        if mean > 1e-8:
            w = w / mean
    return w
