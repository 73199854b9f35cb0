"""Advantage estimators: hand-computed cases, invariants, bad input."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_async.algos import (
    compute_advantages,
    compute_grpo_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_rloo_advantage,
    scores_to_token_rewards,
)

SETTINGS = settings(max_examples=60, deadline=None)


def test_grpo_hand_case():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0])
    adv = compute_grpo_advantage(scores, ["a", "a", "a", "a", "b"])
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6), 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected))
    # Dr.GRPO: no division by std
    adv = compute_grpo_advantage(scores, np.array([7, 7, 7, 7, 9]), norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0]))


def test_grpo_constant_group_and_tensor_index():
    adv = compute_grpo_advantage(torch.tensor([2.0, 2.0, 3.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    s = math.sqrt(2.0)  # unbiased std of [3, 1]
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, 1 / (s + 1e-6), -1 / (s + 1e-6)]))


def test_rloo_hand_case():
    adv = compute_rloo_advantage(torch.tensor([1.0, 2.0, 3.0, 4.0]), [0, 0, 0, 1])
    # leave-one-out baselines: (2+3)/2, (1+3)/2, (1+2)/2; lone sample -> 0
    torch.testing.assert_close(adv, torch.tensor([1 - 2.5, 2 - 2.0, 3 - 1.5, 0.0]))


def test_reinforce_plus_plus_hand_case():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])  # 7.0 sits on padding: ignored
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = compute_reinforce_plus_plus_advantage(rewards, mask, gamma=0.5)
    returns = [0.25, 0.5, 1.0, 1.0, 2.0]  # discounted return-to-go on valid tokens
    mean, var = 0.95, 1.8 / 4  # mean and unbiased variance of the returns
    exp = [(g - mean) / math.sqrt(var + 1e-8) for g in returns]
    expected = torch.tensor([[exp[0], exp[1], exp[2]], [exp[3], exp[4], 0.0]])
    torch.testing.assert_close(adv, expected)


def test_scores_to_token_rewards_and_registry():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    tr = scores_to_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(tr, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]))
    scores = torch.tensor([1.0, 0.0, 3.0])
    adv = compute_advantages("grpo", scores, [0, 0, 1], mask, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]]))
    adv = compute_advantages("rloo", scores, [0, 0, 1], mask)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]]))
    adv = compute_advantages("reinforce_plus_plus", scores, [0, 0, 1], mask)
    assert adv.shape == (3, 3) and float(adv[2].abs().sum()) == 0.0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: compute_grpo_advantage(torch.tensor([1.0, 2.0]), [0]), "index"),
        (lambda: compute_grpo_advantage(torch.tensor([[1.0, 2.0]]), [0]), "scores"),
        (lambda: compute_grpo_advantage(torch.tensor([1.0, float("nan")]), [0, 0]), "scores"),
        (lambda: compute_rloo_advantage(torch.tensor([1.0, float("inf")]), [0, 0]), "scores"),
        (lambda: compute_reinforce_plus_plus_advantage(torch.zeros(2, 3), torch.ones(2, 4)), "response_mask"),
        (lambda: compute_reinforce_plus_plus_advantage(torch.zeros(2, 3), torch.full((2, 3), 0.5)), "response_mask"),
        (lambda: compute_advantages("gae", torch.zeros(2), [0, 0], torch.ones(2, 3)), "adv_estimator"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


groups = st.lists(st.lists(st.floats(-10, 10), min_size=1, max_size=6), min_size=1, max_size=6)


@SETTINGS
@given(groups, st.booleans())
def test_group_advantages_sum_to_zero(gs, norm):
    scores = torch.tensor([s for g in gs for s in g], dtype=torch.float64)
    index = [f"uid{i}" for i, g in enumerate(gs) for _ in g]
    for adv in (compute_grpo_advantage(scores, index, norm_by_std=norm), compute_rloo_advantage(scores, index)):
        assert torch.isfinite(adv).all()
        start = 0
        for g in gs:
            assert abs(float(adv[start : start + len(g)].sum())) < 1e-6 * max(1.0, float(adv.abs().max()))
            start += len(g)


@SETTINGS
@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_reinforce_pp_whitened(lengths, gamma, seed):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths) + 1
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()
    adv = compute_reinforce_plus_plus_advantage(torch.randn(len(lengths), T, generator=g, dtype=torch.float64), mask, gamma=gamma)
    assert torch.isfinite(adv).all()
    assert float(adv[mask == 0].abs().sum()) == 0.0
    assert abs(float(adv[mask == 1].sum())) < 1e-6
