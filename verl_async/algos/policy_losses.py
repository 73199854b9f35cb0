"""verl 0.9's policy losses, chosen by name (`actor_rollout_ref.actor.policy_loss.loss_mode`).

Each loss is a pure function

    loss(logp, old_logp, advantages, mask, *, loss_agg_mode, is_weights, global_tokens, global_seqs,
         loss_scale_factor, <its own keys>) -> (scalar loss, metrics)

with verl's formulas (`verl/trainer/ppo/core_algos.py`, 0.9.1) and verl's key names and defaults
for its own keys (`clip_ratio_low/high/c`, `tau_pos/neg`, `policy_loss.{clip_cov_*, kl_cov_ratio,
ppo_kl_coef, dro_beta}`, the rollout correction of `bypass_mode`). `mask` is the loss mask: padding
and multi-turn tool tokens are 0 and never reach the loss, a gradient, or a metric. `is_weights`
(rollout-correction weights, constants) multiply the per-token loss as in verl. The `global_*`
normalisers make a micro-batch's loss its exact share of the mini-batch loss (see `losses.py`);
without them each function equals verl's on the same tensors with `dp_size=1`.

    vanilla     PPO clip with dual clip (`ppo_policy_loss`)
    gspo        sequence-level ratio exp(mean log r), token-level gradient (arXiv 2507.18071)
    sapo        soft gate sigmoid(tau (r - 1)) 4 / tau instead of a clip; always seq-mean-token-mean
    gpg         -A log pi (no ratio)
    clip_cov    PPO clip plus a random clip_cov_ratio of high-covariance tokens detached (arXiv 2505.22617)
    kl_cov      -A r, plus ppo_kl_coef |log r| on the top kl_cov_ratio covariance tokens
    geo_mean    GMPO: the geometric mean of token-clipped ratios per sequence (arXiv 2507.20673)
    dro         -(A log pi - beta/2 (log r)^2)
    cispo       -sg(clip(r)) A log pi (arXiv 2506.13585)
    dppo_tv     -A sg(min(r, c)) log pi on tokens within a TV trust region (arXiv 2602.04879)
    dppo_kl     the same with a binary-KL trust region
    bypass_mode PPO clip (or REINFORCE) against the rollout policy, with verl's rejection
                and IS weights computed from the policy being trained

Two places where verl's number depends on how a batch is split, and ours does not: `geo_mean`
averages over the micro-batch's rows in verl (here: over the mini-batch's non-empty sequences),
and `clip_cov`/`kl_cov` select tokens within the micro-batch in both (the selection is the
algorithm's, not a normaliser).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional

import torch

from ._checks import check_choice, check_finite, check_mask, check_same_shape, check_tensor, masked_mean
from .losses import agg_loss, ppo_policy_loss
from .rollout_rejection import is_weights as rollout_is_weights
from .rollout_rejection import parse_is_threshold, parse_rejection, rejection_mask

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}
# the arguments every loss takes; the others are the loss's own keys
COMMON_ARGS = ("logp", "old_logp", "advantages", "mask", "loss_agg_mode", "is_weights", "global_tokens",
               "global_seqs", "loss_scale_factor")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    def add(fn: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES[name] = fn
        return fn
    return add


def loss_keys(mode: str) -> tuple[str, ...]:
    """The keys `mode` reads besides the common arguments (e.g. gspo: clip_ratio_low, clip_ratio_high)."""
    fn = POLICY_LOSSES[check_choice("policy_loss.loss_mode", mode, POLICY_LOSSES)]
    return tuple(n for n in inspect.signature(fn).parameters if n not in COMMON_ARGS)


def compute_policy_loss(mode: str, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, *, params: Optional[Mapping[str, Any]] = None, **common: Any
                        ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss named `mode`; `params` may hold every loss's keys, `mode` takes those it reads."""
    keys = loss_keys(mode)
    own = {k: v for k, v in (params or {}).items() if k in keys}
    return POLICY_LOSSES[mode](logp, old_logp, advantages, mask, **own, **common)


def _inputs(logp, old_logp, advantages, mask, is_weights):
    """Checked inputs with padding zeroed (it may hold anything, even NaN) and the bool mask."""
    check_tensor("logp", logp, ndim=2)
    check_same_shape("logp", logp, old_logp=old_logp, advantages=advantages, mask=mask, is_weights=is_weights)
    valid = check_mask("mask", mask)
    for name, x in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages), ("is_weights", is_weights)):
        if x is not None:
            check_finite(name, x, valid)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp, old_logp, advantages = (torch.where(valid, x, zero) for x in (logp, old_logp, advantages))
    if is_weights is not None:
        is_weights = torch.where(valid, is_weights.detach().to(logp.dtype), zero)
    return logp, old_logp, advantages, valid, is_weights


def _finish(pg_losses, valid, is_weights, mode, norm, metrics):
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    loss = agg_loss(pg_losses, valid, mode, **norm)
    metrics = {k: float(v) for k, v in metrics.items()}
    metrics["pg_loss"] = float(loss.detach())
    return loss, metrics


def _clip_bounds(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip_ratio_low/high must be >= 0, got {clip_ratio_low}/{clip_ratio_high}")


@register_policy_loss("vanilla")
def vanilla(logp, old_logp, advantages, mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
            loss_agg_mode="token-mean", is_weights=None, global_tokens=None, global_seqs=None,
            loss_scale_factor=None):
    """verl's `compute_policy_loss_vanilla`: see `ppo_policy_loss`."""
    return ppo_policy_loss(logp, old_logp, advantages, mask, clip_ratio_low=clip_ratio_low,
                           clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                           is_weights=is_weights, global_tokens=global_tokens, global_seqs=global_seqs,
                           loss_scale_factor=loss_scale_factor)


@register_policy_loss("gspo")
def gspo(logp, old_logp, advantages, mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean",
         is_weights=None, global_tokens=None, global_seqs=None, loss_scale_factor=None):
    """s_i = exp(mean_t log r) per sequence; token ratio sg(s_i) pi / sg(pi) (log clamped at 10); PPO clip on it."""
    _clip_bounds(clip_ratio_low, clip_ratio_high)
    logp, old, adv, valid, w = _inputs(logp, old_logp, advantages, mask, is_weights)
    nkl = logp - old
    seq_nkl = (nkl * valid).sum(-1) / valid.sum(-1).clamp(min=1)
    log_ratio = torch.clamp(logp - logp.detach() + seq_nkl.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    metrics = {"pg_clipfrac": masked_mean((loss2 > loss1).float(), valid), "pg_clipfrac_lower": 0.0,
               "ppo_kl": masked_mean(-nkl.detach(), valid)}
    norm = dict(global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return _finish(torch.maximum(loss1, loss2), valid, w, loss_agg_mode, norm, metrics)


@register_policy_loss("sapo")
def sapo(logp, old_logp, advantages, mask, *, tau_pos=1.0, tau_neg=1.05, loss_agg_mode="token-mean",
         is_weights=None, global_tokens=None, global_seqs=None, loss_scale_factor=None):
    """-A f(r), f(r) = sigmoid(tau (r - 1)) 4 / tau with tau_pos for A > 0, tau_neg otherwise.

    verl aggregates SAPO by seq-mean-token-mean whatever `loss_agg_mode` says; so does this."""
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos}/{tau_neg}")
    logp, old, adv, valid, w = _inputs(logp, old_logp, advantages, mask, is_weights)
    nkl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(nkl)
    tau = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=adv.dtype, device=adv.device),
                      torch.as_tensor(tau_neg, dtype=adv.dtype, device=adv.device))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    metrics = {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": masked_mean(-nkl.detach(), valid)}
    norm = dict(global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return _finish(-gates * adv, valid, w, "seq-mean-token-mean", norm, metrics)


@register_policy_loss("gpg")
def gpg(logp, old_logp, advantages, mask, *, loss_agg_mode="token-mean", is_weights=None, global_tokens=None,
        global_seqs=None, loss_scale_factor=None):
    """-A log pi (verl reports no metric; `ppo_kl` here is the usual old - new diagnostic)."""
    logp, old, adv, valid, w = _inputs(logp, old_logp, advantages, mask, is_weights)
    metrics = {"ppo_kl": masked_mean((old - logp).detach(), valid)}
    norm = dict(global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return _finish(-logp * adv, valid, w, loss_agg_mode, norm, metrics)


def _verl_masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """verl_F.masked_mean (denominator + 1e-8): clip_cov's covariance centres, so the selection is verl's."""
    return torch.where(valid, x, torch.zeros_like(x)).sum() / (valid.sum() + 1e-8)


@register_policy_loss("clip_cov")
def clip_cov(logp, old_logp, advantages, mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ratio=0.0002,
             clip_cov_lb=1.0, clip_cov_ub=5.0, loss_agg_mode="token-mean", is_weights=None, global_tokens=None,
             global_seqs=None, loss_scale_factor=None):
    """PPO clip; among the unclipped tokens whose covariance (A - mean A)(log pi - mean log pi) lies in
    (clip_cov_lb, clip_cov_ub), a random max(1, int(clip_cov_ratio * tokens)) get no gradient.

    The draw is `torch.randperm` on the global generator, as in verl (every rank seeds it alike)."""
    _clip_bounds(clip_ratio_low, clip_ratio_high)
    if not clip_cov_ratio > 0:
        raise ValueError(f"policy_loss.clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    logp, old, adv, valid, w = _inputs(logp, old_logp, advantages, mask, is_weights)
    nkl = logp - old
    ratio = torch.exp(nkl)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    with torch.no_grad():
        clipped = (loss2 > loss1) & valid
        cov = (adv - _verl_masked_mean(adv, valid)) * (logp - _verl_masked_mean(logp, valid))
        cov = cov.masked_fill(~valid | clipped, float("-inf"))
        count = max(int(clip_cov_ratio * int(valid.sum())), 1)
        candidates = torch.nonzero((cov < clip_cov_ub) & (cov > clip_cov_lb) & valid)
        corr = torch.ones_like(adv)
        if len(candidates) > 0:
            chosen = candidates[torch.randperm(len(candidates))[: min(count, len(candidates))]]
            corr[chosen[:, 0], chosen[:, 1]] = 0
    metrics = {"pg_clipfrac": masked_mean((corr == 0).float(), valid), "pg_clipfrac_lower": 0.0,
               "ppo_kl": masked_mean(-nkl.detach(), valid)}
    norm = dict(global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return _finish(torch.maximum(loss1, loss2) * corr, valid, w, loss_agg_mode, norm, metrics)


@register_policy_loss("kl_cov")
def kl_cov(logp, old_logp, advantages, mask, *, kl_cov_ratio=0.0002, ppo_kl_coef=0.1, loss_agg_mode="token-mean",
           is_weights=None, global_tokens=None, global_seqs=None, loss_scale_factor=None):
    """-A r, and -A r + ppo_kl_coef |log r| on the max(1, int(kl_cov_ratio * tokens)) valid tokens of
    largest covariance (A - mean A)(log pi - mean log pi). `ppo_kl` is verl's: the mean of |log r|."""
    if not kl_cov_ratio > 0:
        raise ValueError(f"policy_loss.kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    logp, old, adv, valid, w = _inputs(logp, old_logp, advantages, mask, is_weights)
    nkl = logp - old
    ratio = torch.exp(nkl)
    pg_losses = -adv * ratio
    flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    if flat_valid.numel():
        with torch.no_grad():
            a, lp = adv[valid], logp[valid]
            cov = (a - a.mean()) * (lp - lp.mean())
            top = torch.topk(cov, max(1, int(cov.numel() * kl_cov_ratio)), largest=True).indices
            pick = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
            pick[flat_valid[top]] = True
        pg_losses = torch.where(pick.view_as(valid), pg_losses + ppo_kl_coef * nkl.abs(), pg_losses)
    metrics = {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": masked_mean(nkl.detach().abs(), valid)}
    norm = dict(global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return _finish(pg_losses, valid, w, loss_agg_mode, norm, metrics)


@register_policy_loss("geo_mean")
def geo_mean(logp, old_logp, advantages, mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2,
             loss_agg_mode="token-mean", is_weights=None, global_tokens=None, global_seqs=None,
             loss_scale_factor=None):
    """GMPO: per sequence, ratio = exp(mean_t of log r clipped to [-low, high] on A's side), advantage = its
    token mean, loss -A ratio, averaged over sequences (`loss_agg_mode` is not used, as in verl).
    IS weights enter as their per-sequence geometric mean."""
    _clip_bounds(clip_ratio_low, clip_ratio_high)
    logp, old, adv, valid, w = _inputs(logp, old_logp, advantages, mask, is_weights)
    m = valid.to(logp.dtype)
    nkl = logp - old
    sign = torch.sign(adv)
    nkl_clamped = torch.clamp(nkl, -clip_ratio_low, clip_ratio_high)
    nkl_min = sign * torch.minimum(sign * nkl, sign * nkl_clamped)
    length = m.sum(-1)
    ratio = torch.exp((nkl_min * m).sum(-1) / (length + 1e-8))
    seq_adv = (adv * m).sum(-1) / (length + 1e-8)
    pg = -seq_adv * ratio
    if w is not None:
        pg = pg * torch.exp((torch.log(w + 1e-10) * m).sum(-1) / (length + 1e-8))
    rows = global_seqs if global_seqs is not None else pg.shape[0]
    loss = pg.sum() / max(float(rows), 1.0)
    clipped = (nkl != nkl_clamped).float()
    metrics = {"pg_clipfrac": float(masked_mean(clipped * (adv > 0), valid)),
               "pg_clipfrac_lower": float(masked_mean(clipped * (adv < 0), valid)),
               "ppo_kl": float(masked_mean(-nkl.detach(), valid)), "pg_loss": float(loss.detach())}
    return loss, metrics


@register_policy_loss("dro")
def dro(logp, old_logp, advantages, mask, *, dro_beta=None, loss_agg_mode="token-mean", is_weights=None,
        global_tokens=None, global_seqs=None, loss_scale_factor=None):
    """Direct Reward Optimization: -(A log pi - dro_beta/2 (log r)^2); dro_beta must be > 0."""
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"policy_loss.dro_beta must be a positive number for loss_mode=dro, got {dro_beta!r}")
    logp, old, adv, valid, w = _inputs(logp, old_logp, advantages, mask, is_weights)
    log_ratio = logp - old
    metrics = {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": masked_mean(-log_ratio.detach(), valid)}
    norm = dict(global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return _finish(-(logp * adv - 0.5 * dro_beta * log_ratio.square()), valid, w, loss_agg_mode, norm, metrics)


@register_policy_loss("cispo")
def cispo(logp, old_logp, advantages, mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean",
          is_weights=None, global_tokens=None, global_seqs=None, loss_scale_factor=None):
    """-sg(clip(r, 1 - low, 1 + high)) A log pi: every token keeps a gradient, its weight is clipped."""
    _clip_bounds(clip_ratio_low, clip_ratio_high)
    logp, old, adv, valid, w = _inputs(logp, old_logp, advantages, mask, is_weights)
    nkl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(nkl)
    clipped = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    metrics = {"pg_clipfrac": masked_mean((ratio != clipped).float(), valid), "pg_clipfrac_lower": 0.0,
               "ppo_kl": masked_mean(-nkl.detach(), valid)}
    norm = dict(global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    return _finish(-clipped.detach() * adv * logp, valid, w, loss_agg_mode, norm, metrics)


def _dppo(logp, old_logp, advantages, mask, trust, *, clip_ratio_c, loss_agg_mode, is_weights, **norm):
    logp, old, adv, valid, w = _inputs(logp, old_logp, advantages, mask, is_weights)
    nkl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(nkl)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    with torch.no_grad():
        inside = trust(torch.exp(logp), torch.exp(old), logp, old, adv).float()
    metrics = {"pg_clipfrac": masked_mean(1.0 - inside, valid),
               "pg_clipfrac_lower": masked_mean((ratio > clip_ratio_c).float() * inside, valid),
               "ppo_kl": masked_mean(-nkl.detach(), valid)}
    return _finish(-adv * truncated * logp * inside, valid, w, loss_agg_mode, norm, metrics)


@register_policy_loss("dppo_tv")
def dppo_tv(logp, old_logp, advantages, mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
            loss_agg_mode="token-mean", is_weights=None, global_tokens=None, global_seqs=None,
            loss_scale_factor=None):
    """DPPO-Binary-TV: -A sg(min(r, clip_ratio_c)) log pi on tokens with pi - pi_old <= clip_ratio_high
    (A > 0) or >= -clip_ratio_low (A <= 0); clip_ratio_low/high are TV thresholds here."""
    _clip_bounds(clip_ratio_low, clip_ratio_high)

    def trust(p, p_old, _lp, _lo, adv):
        return torch.where(adv > 0, (p - p_old) <= clip_ratio_high, (p - p_old) >= -clip_ratio_low)

    return _dppo(logp, old_logp, advantages, mask, trust, clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                 is_weights=is_weights, global_tokens=global_tokens, global_seqs=global_seqs,
                 loss_scale_factor=loss_scale_factor)


@register_policy_loss("dppo_kl")
def dppo_kl(logp, old_logp, advantages, mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
            loss_agg_mode="token-mean", is_weights=None, global_tokens=None, global_seqs=None,
            loss_scale_factor=None):
    """DPPO-Binary-KL: as dppo_tv with the binary KL of (pi_old, pi) as the trust region's divergence; a token
    moving against its advantage's direction always stays."""
    _clip_bounds(clip_ratio_low, clip_ratio_high)

    def trust(p, p_old, lp, lo, adv):
        bkl = p_old * (lo - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        return torch.where(adv > 0, (bkl <= clip_ratio_high) | (p <= p_old), (bkl <= clip_ratio_low) | (p >= p_old))

    return _dppo(logp, old_logp, advantages, mask, trust, clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                 is_weights=is_weights, global_tokens=global_tokens, global_seqs=global_seqs,
                 loss_scale_factor=loss_scale_factor)


@register_policy_loss("bypass_mode")
def bypass_mode(logp, old_logp, advantages, mask, *, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                loss_type="ppo_clip", rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                rollout_rs=None, rollout_rs_threshold=None, loss_agg_mode="token-mean", is_weights=None,
                global_tokens=None, global_seqs=None, loss_scale_factor=None):
    """verl's bypass mode: `old_logp` ARE the rollout's log-probs. From log r = log pi - log pi_rollout
    (pi: the policy being trained, no gradient) the `rollout_rs` criteria drop tokens or sequences from
    the mask and `rollout_is` gives weights; then `ppo_clip` is the vanilla loss on the kept tokens
    (the PPO ratio already is pi / pi_rollout: no weights) and `reinforce` is -w A log pi.

    `is_weights` from outside are ignored, as in verl (they are computed here). The normalisers stay
    the mini-batch's: a rejected token counts as a zero, as in verl."""
    check_choice("rollout_correction.loss_type", loss_type, BYPASS_LOSS_TYPES)
    logp_z, old, adv, valid, _ = _inputs(logp, old_logp, advantages, mask, None)
    log_ratio = (logp_z - old).detach()
    keep = valid
    metrics: dict[str, float] = {}
    if rollout_rs is not None and bool(valid.any()):
        keep, metrics = rejection_mask(log_ratio, valid, parse_rejection(rollout_rs, rollout_rs_threshold))
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        lower, upper = parse_is_threshold(rollout_is_threshold)
        weights = rollout_is_weights(log_ratio, valid, rollout_is, lower, upper, rollout_is_batch_normalize)
    norm = dict(global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=loss_scale_factor)
    if loss_type == "ppo_clip":
        loss, pg = ppo_policy_loss(logp, old_logp, advantages, keep, clip_ratio_low=clip_ratio_low,
                                   clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                                   loss_agg_mode=loss_agg_mode, **norm)
    else:
        pg_losses = -adv * logp_z * (weights if weights is not None else 1.0)
        loss, pg = _finish(pg_losses, keep, None, loss_agg_mode, norm,
                           {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0,
                            "ppo_kl": masked_mean(-log_ratio, keep)})
    pg.update(metrics)
    return loss, pg
