"""agg_loss, PPO policy loss, decoupled PPO, and gradient-accumulation equivalence."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_async.algos import (
    LOSS_AGG_MODES,
    agg_loss,
    decoupled_ppo_loss,
    global_batch_info,
    ppo_policy_loss,
    rollout_correction,
)

SETTINGS = settings(max_examples=60, deadline=None)

L = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0], [9.0, 9.0, 9.0]])  # NaN sits on padding
M = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (6 + 4) / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),  # the empty third row does not count
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 + 4) / 2 / 3),  # / T = mask.shape[-1]
    ],
)
def test_agg_loss_hand_values(mode, expected):
    assert float(agg_loss(L, M, mode)) == pytest.approx(expected)


def test_agg_loss_scale_factor_and_global_counts():
    assert float(agg_loss(L, M, "seq-mean-token-sum-norm", loss_scale_factor=10)) == pytest.approx(0.5)
    assert float(agg_loss(L, M, "token-mean", global_tokens=20)) == pytest.approx(0.5)
    assert float(agg_loss(L, M, "seq-mean-token-mean", global_seqs=6)) == pytest.approx(1.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_zero_mask_gives_zero_loss_and_zero_grad(mode):
    x = torch.randn(2, 3, requires_grad=True)
    loss = agg_loss(x, torch.zeros(2, 3), mode)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(x.grad, torch.zeros(2, 3))
    logp = torch.randn(2, 3, requires_grad=True)
    pg, metrics = ppo_policy_loss(logp, torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3), loss_agg_mode=mode)
    pg.backward()
    assert float(pg.detach()) == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_gradcheck(mode):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert torch.autograd.gradcheck(lambda t: agg_loss(t, mask, mode), (x,))


def test_ppo_hand_case():
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 5.0]])
    old = torch.full((1, 5), -1.0)
    logp = (old + ratios.log()).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    loss, m = ppo_policy_loss(logp, old, adv, torch.ones(1, 5))
    # per token: -1.2 (upper clip), -0.5, 0.8 (lower clip), 1.5, 3.0 (dual clip at c=3)
    assert float(loss.detach()) == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5 + 3.0) / 5)
    assert m["pg_clipfrac"] == pytest.approx(2 / 5)
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 5)
    assert m["ppo_kl"] == pytest.approx(-float(ratios.log().mean()))
    loss.backward()
    # gradient -A * ratio / 5 where unclipped, 0 where a clip is active
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 5, 0.0, 1.5 / 5, 0.0]]))


def test_ppo_asymmetric_clip_no_dual_and_weights():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.25, 0.7, 5.0]]))
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    # clip_ratio_high=0.3 leaves 1.25 unclipped; low=0.2 clips 0.7 -> 0.8 for A<0; no dual clip -> 5.0 stays
    loss, m = ppo_policy_loss(logp, old, adv, torch.ones(1, 3), clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=None)
    assert float(loss.detach()) == pytest.approx((-1.25 + 0.8 + 5.0) / 3)
    assert m["pg_clipfrac_lower"] == 0.0
    w = torch.tensor([[2.0, 1.0, 0.5]])
    loss_w, _ = ppo_policy_loss(logp, old, adv, torch.ones(1, 3), is_weights=w, clip_ratio_c=None, clip_ratio_high=0.3)
    assert float(loss_w) == pytest.approx((-2.5 + 0.8 + 2.5) / 3)


def test_ppo_gradcheck():
    g = torch.Generator().manual_seed(3)
    old = torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(3, 5, generator=g) > 0.3).double()
    # ratios spread well away from the clip kinks at 0.8 / 1.2 / dual clip 3
    delta = torch.tensor([-0.9, -0.05, 0.1, 0.7, 1.6] * 3, dtype=torch.float64).reshape(3, 5)
    logp = (old + delta).requires_grad_()
    for mode in LOSS_AGG_MODES:
        assert torch.autograd.gradcheck(lambda x: ppo_policy_loss(x, old, adv, mask, loss_agg_mode=mode)[0], (logp,))


def test_ppo_on_policy_first_step():
    logp = torch.randn(4, 6)
    loss, m = ppo_policy_loss(logp, logp.clone(), torch.randn(4, 6), torch.ones(4, 6))
    assert m["ppo_kl"] == 0.0 and m["pg_clipfrac"] == 0.0


def test_decoupled_equals_composition():
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 4, generator=g)
    rollout = old + 0.3 * torch.randn(3, 4, generator=g)
    logp = (old + 0.1 * torch.randn(3, 4, generator=g)).requires_grad_()
    adv = torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    corr = {"level": "token", "mode": "mask", "upper": 1.3, "veto_threshold": 1e-4}
    loss, metrics = decoupled_ppo_loss(logp, old, rollout, adv, mask, correction=corr, loss_agg_mode="seq-mean-token-mean")
    w, new_mask, cm = rollout_correction(old, rollout, mask, **corr)
    ref, _ = ppo_policy_loss(logp, old, adv, new_mask, is_weights=w, loss_agg_mode="seq-mean-token-mean")
    torch.testing.assert_close(loss, ref)
    assert metrics["rollout_corr/k3_kl"] == cm["k3_kl"]
    # no mismatch: decoupled == plain PPO
    plain, _ = ppo_policy_loss(logp, old, adv, mask)
    same, _ = decoupled_ppo_loss(logp, old, old.clone(), adv, mask)
    torch.testing.assert_close(same, plain)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: agg_loss(torch.zeros(2, 3), torch.ones(2, 2)), "mask"),
        (lambda: agg_loss(torch.zeros(2, 3), torch.ones(2, 3), "seq-mean"), "loss_agg_mode"),
        (lambda: agg_loss(torch.tensor([[float("nan"), 0.0]]), torch.ones(1, 2)), "loss_mat"),
        (lambda: agg_loss(torch.zeros(2, 3), torch.ones(2, 3), global_tokens=-1), "global_tokens"),
        (lambda: ppo_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)), "advantages"),
        (lambda: ppo_policy_loss(torch.zeros(1, 2), torch.tensor([[0.0, float("inf")]]), torch.zeros(1, 2), torch.ones(1, 2)), "old_logp"),
        (lambda: ppo_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), clip_ratio_c=0.5), "clip_ratio_c"),
        (lambda: global_batch_info([]), "masks"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@SETTINGS
@given(st.lists(st.integers(0, 5), min_size=1, max_size=8), st.floats(-5, 5))
def test_agg_loss_of_constant(lengths, c):
    T = max(max(lengths), 1)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).double()
    x = torch.full(mask.shape, c, dtype=torch.float64)
    nonempty = [n for n in lengths if n]
    expect_mean = c if nonempty else 0.0
    assert float(agg_loss(x, mask, "token-mean")) == pytest.approx(expect_mean, abs=1e-9)
    assert float(agg_loss(x, mask, "seq-mean-token-mean")) == pytest.approx(expect_mean, abs=1e-9)
    avg_len = sum(nonempty) / len(nonempty) if nonempty else 0.0
    assert float(agg_loss(x, mask, "seq-mean-token-sum")) == pytest.approx(c * avg_len, abs=1e-9)
    assert float(agg_loss(x, mask, "seq-mean-token-sum-norm")) == pytest.approx(c * avg_len / T, abs=1e-9)


def _random_batch(seed, B=9, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T  # the full batch spans all T columns
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    return g, mask, lengths


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(1, 5), st.sampled_from(LOSS_AGG_MODES), st.booleans())
def test_micro_batches_sum_to_full_batch(seed, parts, mode, trim):
    """Sum over micro-batches of globally-normalised micro losses == full loss; same gradient.
    With `trim`, each micro-batch is cut to its own longest row (as a packer would pad)."""
    g, mask, lengths = _random_batch(seed)
    B, T = mask.shape
    loss_mat = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    full = agg_loss(loss_mat, mask, mode)
    (full_grad,) = torch.autograd.grad(full, loss_mat)

    assign = torch.randint(0, parts, (B,), generator=g)
    groups = [torch.nonzero(assign == p).flatten() for p in range(parts)]
    groups = [ix for ix in groups if len(ix)]
    width = [int(lengths[ix].max()) if trim else T for ix in groups]
    micro_masks = [mask[ix, :w] for ix, w in zip(groups, width)]
    info = global_batch_info(micro_masks)
    if trim:
        info["loss_scale_factor"] = T  # a constant horizon, as Dr.GRPO wants
    total = sum(agg_loss(loss_mat[ix, :w], m, mode, **info) for ix, w, m in zip(groups, width, micro_masks))
    (acc_grad,) = torch.autograd.grad(total, loss_mat)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(acc_grad, full_grad)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.sampled_from(LOSS_AGG_MODES))
def test_ppo_micro_batches_and_dp_ranks(seed, parts, mode):
    """Two DP ranks x micro-batches: global counts summed over ranks -> sum of losses == full."""
    g, mask, _ = _random_batch(seed, B=10)
    B, T = mask.shape
    old = -torch.rand(B, T, generator=g, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    full, _ = ppo_policy_loss(logp, old, adv, mask, loss_agg_mode=mode)
    (full_grad,) = torch.autograd.grad(full, logp)

    ranks = [torch.arange(0, B, 2), torch.arange(1, B, 2)]
    micro = [torch.tensor_split(r, parts) for r in ranks]
    per_rank = [global_batch_info([mask[ix] for ix in mbs if len(ix)]) for mbs in micro]
    info = {  # what an all-reduce (SUM counts, MAX horizon) gives every rank
        "global_tokens": sum(r["global_tokens"] for r in per_rank),
        "global_seqs": sum(r["global_seqs"] for r in per_rank),
        "loss_scale_factor": max(r["loss_scale_factor"] for r in per_rank),
    }
    total = sum(
        ppo_policy_loss(logp[ix], old[ix], adv[ix], mask[ix], loss_agg_mode=mode, **info)[0]
        for mbs in micro
        for ix in mbs
        if len(ix)
    )
    (acc_grad,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(acc_grad, full_grad)
