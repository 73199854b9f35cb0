"""KL estimators between the policy and the reference (Schulman's k1/k2/k3).

verl's `kl_penalty` semantics, including its clamps and the optional `+` suffix
(`k1+`, `k3+`, `low_var_kl+`, `abs+`): value of the named estimator, gradient of
k2 (straight-through), which is the unbiased gradient of KL.
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_finite, check_mask, check_same_shape, check_tensor

_BASE_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS = _BASE_KINDS + tuple(k + "+" for k in _BASE_KINDS if k not in ("mse", "k2"))


def _kl_value(delta: torch.Tensor, kind: str) -> torch.Tensor:
    """`delta = logp - ref_logp`."""
    if kind in ("kl", "k1"):
        return delta
    if kind == "abs":
        return delta.abs()
    if kind in ("mse", "k2"):
        return 0.5 * delta.square()
    # low_var_kl / k3: exp(ref - logp) - (ref - logp) - 1, input and output clamped for stability.
    x = torch.clamp(-delta, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(x) - x - 1.0, min=-10.0, max=10.0)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy (`logp`) and the reference (`ref_logp`).

    kinds: `kl`/`k1` = logp - ref; `abs` = |logp - ref|; `mse`/`k2` = 0.5 (logp - ref)^2;
    `low_var_kl`/`k3` = exp(ref - logp) - (ref - logp) - 1 with the input clamped to
    [-20, 20] and the output to [-10, 10]. Suffix `+`: that value, k2's gradient.
    Aggregate with `agg_loss` under the response mask.
    """
    check_tensor("logp", logp)
    check_same_shape("logp", logp, ref_logp=ref_logp)
    check_choice("kind", kind, KL_KINDS)
    check_finite("logp", logp)
    check_finite("ref_logp", ref_logp)
    delta = logp - ref_logp
    straight_through = kind.endswith("+")
    value = _kl_value(delta, kind.rstrip("+"))
    if not straight_through:
        return value
    k2 = 0.5 * delta.square()
    return k2 - k2.detach() + value.detach()


def adaptive_kl_coef(coef: float, current_kl: float, *, target_kl: float, horizon: int, n_steps: int) -> float:
    """verl's AdaptiveKLController.update (Ziegler et al. 2019): the in-reward KL coefficient
    after a step that measured `current_kl` over `n_steps` samples (verl: the batch's
    responses). It moves by at most 20% * n_steps / horizon per step, towards keeping the
    KL at `target_kl`: `coef * (1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon)`.
    """
    if not target_kl > 0 or not horizon > 0 or n_steps < 0:
        raise ValueError(f"need target_kl > 0, horizon > 0, n_steps >= 0; got {target_kl!r}, {horizon!r}, {n_steps!r}")
    error = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return float(coef) * (1.0 + error * n_steps / horizon)


@torch.no_grad()
def kl_in_reward(
    token_scores: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, float]:
    """`use_kl_in_reward`: token rewards `scores - kl_coef * KL` on valid tokens (0 on
    padding) and the batch's mean per-sequence KL (the metric verl feeds its adaptive
    controller)."""
    check_tensor("token_scores", token_scores, ndim=2)
    check_same_shape("token_scores", token_scores, old_logp=old_logp, ref_logp=ref_logp, response_mask=response_mask)
    mask = check_mask("response_mask", response_mask)
    check_finite("token_scores", token_scores, mask)
    m = mask.to(old_logp.dtype)
    kl = kl_penalty(old_logp, ref_logp, kind) * m
    rewards = (token_scores - kl_coef * kl) * m
    seq_kl = kl.sum(-1) / m.sum(-1).clamp(min=1)
    nonempty = mask.any(-1)
    mean_kl = float(seq_kl[nonempty].mean()) if bool(nonempty.any()) else 0.0
    return rewards, mean_kl
