"""Outcome advantage estimators (verl semantics): GRPO, RLOO, REINFORCE++.

Group estimators take one scalar score per response and the id of its prompt
group and return one advantage per response, `[B]`; the trainer broadcasts it
over the response tokens (`adv[:, None] * response_mask`). REINFORCE++ works on
token rewards and returns `[B, T]`. All run without gradient: advantages are
constants of the policy-gradient loss.

`compute_advantages(name, ...)` is the by-name entry the trainer uses
(`algorithm.adv_estimator`), always returning `[B, T]`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ._checks import check_choice, check_finite, check_mask, check_same_shape, check_tensor


def group_ids(index: Sequence[Any] | torch.Tensor, batch: int, device: torch.device | None = None) -> torch.Tensor:
    """Map arbitrary group ids (str, int, uid ...) to dense ints 0..G-1 in order of first appearance."""
    if isinstance(index, torch.Tensor):
        index = index.tolist()
    else:
        index = list(index)
    if len(index) != batch:
        raise ValueError(f"index has {len(index)} entries but scores has {batch}; they must match")
    dense: dict[Any, int] = {}
    out = [dense.setdefault(g, len(dense)) for g in index]
    return torch.tensor(out, dtype=torch.long, device=device)


def _check_scores(scores: torch.Tensor) -> torch.Tensor:
    check_tensor("scores", scores, ndim=1)
    if not scores.is_floating_point():
        scores = scores.float()
    check_finite("scores", scores)
    return scores


def _group_stats(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group size, group mean and unbiased group std (std 0 for groups of one)."""
    num_groups = int(gid.max()) + 1 if gid.numel() else 0
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, torch.ones_like(scores))
    total = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores)
    mean = total / count
    sq = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return count[gid], mean[gid], std[gid]


@torch.no_grad()
def compute_grpo_advantage(
    scores: torch.Tensor,
    index: Sequence[Any] | torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO: `(s - mean_g) / (std_g + eps)` per group g, std unbiased (Bessel).

    `norm_by_std=False` is Dr.GRPO (`s - mean_g`). A group of one has no baseline and
    gets advantage 0 (verl instead passes its raw score through; we follow the issue:
    a lone sample carries no relative signal). A constant group gets 0.
    """
    scores = _check_scores(scores)
    gid = group_ids(index, scores.shape[0], scores.device)
    if scores.numel() == 0:
        return scores.clone()
    count, mean, std = _group_stats(scores, gid)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


@torch.no_grad()
def compute_rloo_advantage(scores: torch.Tensor, index: Sequence[Any] | torch.Tensor) -> torch.Tensor:
    """RLOO: `s_i - mean_{j != i} s_j = n/(n-1) * (s_i - mean_g)`; a group of one gets 0
    (as verl's vectorised RLOO)."""
    scores = _check_scores(scores)
    gid = group_ids(index, scores.shape[0], scores.device)
    if scores.numel() == 0:
        return scores.clone()
    count, mean, _ = _group_stats(scores, gid)
    adv = (scores - mean) * count / (count - 1).clamp(min=1)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`(x - mean) / sqrt(var + eps)` over the masked-in entries, var unbiased (verl's
    masked_whiten); fewer than 2 entries give var 0. Masked-out entries become 0."""
    m = mask.to(values.dtype)
    n = m.sum()
    mean = (values * m).sum() / n.clamp(min=1)
    var = (((values - mean) ** 2) * m).sum() / (n - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * m


@torch.no_grad()
def compute_reinforce_plus_plus_advantage(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++: discounted return-to-go per token, whitened over all valid tokens
    of the batch, 0 on padding.

    `G_t = r_t + gamma * G_{t+1}` over the valid tokens; a masked token inside the
    response (a multi-turn response's tool answer) gets 0 and passes the running return
    on unchanged, so a final reward reaches the first turn's tokens. Padding follows the
    last valid token, where the return is still 0, so nothing flows across it (verl's
    recursion, which resets at every masked token, agrees on single-turn masks).
    """
    check_tensor("token_rewards", token_rewards, ndim=2)
    check_same_shape("token_rewards", token_rewards, response_mask=response_mask)
    mask = check_mask("response_mask", response_mask)
    if not token_rewards.is_floating_point():
        token_rewards = token_rewards.float()
    check_finite("token_rewards", token_rewards, mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    m = mask.to(token_rewards.dtype)
    rewards = token_rewards * m
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(m[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running * m[:, t]
    return masked_whiten(returns, mask)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each response's scalar score on its last valid token (`[B]` -> `[B, T]`).

    The last valid token by position, not by count: a multi-turn response's mask has holes
    (tool answers). A response with no valid token gets no reward anywhere."""
    check_tensor("scores", scores, ndim=1)
    check_tensor("response_mask", response_mask, ndim=2)
    if scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores has {scores.shape[0]} rows but response_mask has {response_mask.shape[0]}; they must match"
        )
    mask = check_mask("response_mask", response_mask)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.zeros_like(positions)).max(dim=-1).values
    out = torch.zeros(mask.shape, dtype=scores.dtype if scores.is_floating_point() else torch.float32, device=scores.device)
    out.scatter_(1, last[:, None], scores[:, None].to(out.dtype))
    return out * mask.to(out.dtype)


def _grpo(scores, index, mask, *, norm_adv_by_std_in_grpo=True, gamma=1.0):
    return compute_grpo_advantage(scores, index, norm_by_std=norm_adv_by_std_in_grpo)[:, None] * mask


def _rloo(scores, index, mask, *, norm_adv_by_std_in_grpo=True, gamma=1.0):
    return compute_rloo_advantage(scores, index)[:, None] * mask


def _reinforce_pp(scores, index, mask, *, norm_adv_by_std_in_grpo=True, gamma=1.0):
    return compute_reinforce_plus_plus_advantage(scores_to_token_rewards(scores, mask), mask, gamma=gamma)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": _grpo,
    "rloo": _rloo,
    "reinforce_plus_plus": _reinforce_pp,
}


def compute_advantages(
    estimator: str,
    scores: torch.Tensor,
    index: Sequence[Any] | torch.Tensor,
    response_mask: torch.Tensor,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    gamma: float = 1.0,
) -> torch.Tensor:
    """Token advantages `[B, T]` (0 on padding) for `algorithm.adv_estimator` by name.

    `scores [B]` are the sequence rewards (already including any KL-in-reward term:
    sum the token rewards first). For `reinforce_plus_plus` each score is placed on
    the response's last valid token before discounting.
    """
    fn = ADVANTAGE_ESTIMATORS[check_choice("adv_estimator", estimator, ADVANTAGE_ESTIMATORS)]
    check_tensor("response_mask", response_mask, ndim=2)
    if scores.dim() != 1 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores must be [B] with B = response_mask rows ({response_mask.shape[0]}), got {tuple(scores.shape)}"
        )
    mask = check_mask("response_mask", response_mask).to(scores.dtype if scores.is_floating_point() else torch.float32)
    return fn(scores, index, mask, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, gamma=gamma)
