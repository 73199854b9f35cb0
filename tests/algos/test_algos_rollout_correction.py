"""Rollout correction (TIS/MIS): hand cases per level/mode, RS, veto, batch norm, bounds."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_async.algos import rollout_correction, vetoed_sequences

E = math.e
OLD = torch.zeros(2, 3)
ROLLOUT = torch.tensor([[0.0, -1.0, 1.0], [-0.5, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# r = old - rollout = [[0, 1, -1], [0.5, 0, pad]]


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_token_truncate():
    w, m, met = rollout_correction(OLD, ROLLOUT, MASK)
    torch.testing.assert_close(w, _t([[1.0, 2.0, 1 / E], [math.exp(0.5), 1.0, 0.0]]))
    assert torch.equal(m, MASK)
    assert met["truncate_frac"] == pytest.approx(1 / 5)


def test_sequence_and_geometric_levels():
    w, _, _ = rollout_correction(OLD, ROLLOUT, MASK, level="sequence", upper=None)
    torch.testing.assert_close(w, _t([[1.0, 1.0, 1.0], [math.exp(0.5), math.exp(0.5), 0.0]]))
    w, _, _ = rollout_correction(OLD, ROLLOUT, MASK, level="geometric")
    torch.testing.assert_close(w, _t([[1.0, 1.0, 1.0], [math.exp(0.25), math.exp(0.25), 0.0]]))


def test_clip_mode_default_lower_is_inverse_upper():
    w, _, met = rollout_correction(OLD, ROLLOUT, MASK, mode="clip", upper=2.0)
    torch.testing.assert_close(w, _t([[1.0, 2.0, 0.5], [math.exp(0.5), 1.0, 0.0]]))
    assert met["clip_frac"] == pytest.approx(2 / 5)


def test_mask_mode_keeps_weights_and_drops_tokens():
    w, m, met = rollout_correction(OLD, ROLLOUT, MASK, mode="mask", lower=0.5, upper=2.0)
    torch.testing.assert_close(w, _t([[1.0, E, 1 / E], [math.exp(0.5), 1.0, 0.0]]))
    assert torch.equal(m, torch.tensor([[1, 0, 0], [1, 1, 0]]))
    assert met["mask_frac"] == pytest.approx(2 / 5)
    assert met["rejected_token_frac"] == pytest.approx(2 / 5)


def test_same_version_tokens_get_weight_one_and_no_rejection_when_their_log_probs_agree():
    """True on-policy mode: the tokens of the trainer's version have old == rollout (here (0,0) and (1,1)): weight
    exactly 1 and never rejected, so the weights != 1 and the rejections all come from the stale tokens."""
    same = torch.tensor([[True, False, False], [False, True, True]])  # (1,2) is padding: not counted
    _, m, met = rollout_correction(OLD, ROLLOUT, MASK, mode="mask", lower=0.5, upper=2.0, same_version=same)
    assert met["same_version_weight_dev_max"] == 0.0 and met["same_version_rejected_frac"] == 0.0
    assert met["rejected_token_frac"] == pytest.approx(2 / 5)  # the two stale tokens outside [0.5, 2]
    # a same-version token whose log-probs differ (the mode off): its weight and rejection show
    same[0, 1] = True
    _, _, met = rollout_correction(OLD, ROLLOUT, MASK, mode="mask", lower=0.5, upper=2.0, same_version=same)
    assert met["same_version_weight_dev_max"] == pytest.approx(E - 1)
    assert met["same_version_rejected_frac"] == pytest.approx(1 / 3)
    # sequence level: only sequences of same-version tokens count; row 1 (e^0.5) is one, row 0 is not
    same = torch.tensor([[True, True, False], [True, True, False]])
    _, _, met = rollout_correction(OLD, ROLLOUT, MASK, level="sequence", upper=None, rs=True, rs_upper=1.5,
                                   same_version=same)
    assert met["same_version_weight_dev_max"] == pytest.approx(math.exp(0.5) - 1)
    assert met["same_version_rejected_frac"] == 1.0
    _, _, met = rollout_correction(OLD, ROLLOUT, MASK, same_version=torch.zeros(2, 3, dtype=torch.bool))
    assert "same_version_weight_dev_max" not in met and "same_version_rejected_frac" not in met


def test_rejection_sampling_at_sequence_level():
    w, m, met = rollout_correction(OLD, ROLLOUT, MASK, upper=3.0, rs=True, rs_level="sequence", rs_lower=0.9, rs_upper=1.5)
    torch.testing.assert_close(w, _t([[1.0, E, 1 / E], [math.exp(0.5), 1.0, 0.0]]))  # IS weights unchanged
    assert torch.equal(m, torch.tensor([[1, 1, 1], [0, 0, 0]]))  # row 1: seq weight e^0.5 > 1.5
    assert met["rs_frac"] == pytest.approx(2 / 5)
    # rs bounds default to the IS bounds [1/upper, upper] at the IS level
    _, m, _ = rollout_correction(OLD, ROLLOUT, MASK, upper=2.0, rs=True)
    assert torch.equal(m, torch.tensor([[1, 0, 0], [1, 1, 0]]))


def test_veto_ratio_rule_drops_whole_sequence():
    _, m, met = rollout_correction(OLD, ROLLOUT, MASK, veto_threshold=math.exp(-0.5), veto_rule="ratio")
    assert torch.equal(m, torch.tensor([[0, 0, 0], [1, 1, 0]]))  # row 0 holds r = -1 < -0.5
    assert met["veto_frac"] == pytest.approx(1 / 2)


# Old-policy probabilities of each token (hand-picked), rollout log-probs equal to them except
# row 1, token 0, where the engine found the token far likelier than the trainer (ratio 1e-3).
VETO_OLD_P = [[0.5, 1e-7, 0.9], [1e-3, 0.5, 1e-9], [0.2, 0.3, 0.4]]  # row 1, token 2 is padding
VETO_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])


def _veto_case():
    old = torch.tensor(VETO_OLD_P, dtype=torch.float64).log()
    rollout = old.clone()
    rollout[1, 0] = math.log(1.0)  # ratio pi_old / pi_rollout = 1e-3
    return old, rollout


def test_veto_default_rule_is_the_old_policy_probability():
    """slime's rule (docs/architecture.md "Rollout correction"): veto a sequence holding a token with pi_old < threshold."""
    old, rollout = _veto_case()
    _, m, met = rollout_correction(old, rollout, VETO_MASK, veto_threshold=1e-6)
    # row 0: p = 1e-7 < 1e-6 -> vetoed although its ratio is exactly 1;
    # row 1: smallest valid p = 1e-3 (the 1e-9 is padding) -> kept although its ratio is 1e-3
    assert torch.equal(m, torch.tensor([[0, 0, 0], [1, 1, 0], [1, 1, 1]]))
    assert met["veto_frac"] == pytest.approx(1 / 3)
    assert met["rejected_token_frac"] == pytest.approx(3 / 8)


def test_veto_ratio_rule_looks_at_the_ratio_only():
    old, rollout = _veto_case()
    _, m, met = rollout_correction(old, rollout, VETO_MASK, veto_threshold=1e-2, veto_rule="ratio")
    # row 0: ratios all 1 -> kept despite p = 1e-7; row 1: ratio 1e-3 < 1e-2 -> vetoed
    assert torch.equal(m, torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 1]]))
    assert met["veto_frac"] == pytest.approx(1 / 3)


def test_vetoed_sequences_threshold_is_strict():
    old = torch.tensor([[math.log(0.25), math.log(0.5)], [math.log(0.5), math.log(0.5)]])
    valid = torch.ones(2, 2, dtype=torch.bool)
    zero = torch.zeros(2, 2)
    assert vetoed_sequences(old, zero, valid, 0.25).tolist() == [False, False]  # p == threshold: kept
    assert vetoed_sequences(old, zero, valid, 0.3).tolist() == [True, False]
    assert vetoed_sequences(old, zero, valid, 0.6).tolist() == [True, True]
    assert vetoed_sequences(old, zero, valid, 0.6, "ratio").tolist() == [False, False]  # ratio 1 everywhere


def test_batch_normalize():
    w, _, _ = rollout_correction(OLD, ROLLOUT, MASK, batch_normalize=True)
    raw = [1.0, 2.0, 1 / E, math.exp(0.5), 1.0]
    mean = sum(raw) / 5
    torch.testing.assert_close(w, _t([[1 / mean, 2 / mean, 1 / E / mean], [math.exp(0.5) / mean, 1 / mean, 0.0]]))
    assert float(w[MASK.bool()].mean()) == pytest.approx(1.0)
    w, _, _ = rollout_correction(OLD, ROLLOUT, MASK, level="sequence", batch_normalize=True)
    seq_mean = (1.0 + math.exp(0.5)) / 2  # mean over sequences, not tokens
    torch.testing.assert_close(w, _t([[1 / seq_mean] * 3, [math.exp(0.5) / seq_mean] * 2 + [0.0]]))


def test_metrics():
    _, _, met = rollout_correction(OLD, ROLLOUT, MASK)
    assert met["train_rollout_logprob_abs_diff"] == pytest.approx((0 + 1 + 1 + 0.5 + 0) / 5)
    # r' = rollout - old = [0, -1, 1, -0.5, 0]
    k3 = (0 + (math.exp(-1) + 1 - 1) + (E - 1 - 1) + (math.exp(-0.5) + 0.5 - 1) + 0) / 5
    assert met["k3_kl"] == pytest.approx(k3, rel=1e-5)
    assert met["kl"] == pytest.approx((0 - 1 + 1 - 0.5 + 0) / 5)
    assert met["training_ppl"] == pytest.approx(1.0)
    assert met["rollout_ppl"] == pytest.approx((1.0 + math.exp(0.25)) / 2)
    assert met["weight_max"] == pytest.approx(2.0) and met["weight_min"] == pytest.approx(1 / E)


def test_no_gradient_and_on_policy_identity():
    old = torch.randn(2, 4, requires_grad=True)
    w, m, met = rollout_correction(old, old.detach().clone(), torch.ones(2, 4), batch_normalize=True)
    assert not w.requires_grad
    torch.testing.assert_close(w, torch.ones(2, 4))
    assert met["k3_kl"] == 0.0 and met["train_rollout_logprob_abs_diff"] == 0.0


def test_all_zero_mask_defined():
    w, m, met = rollout_correction(OLD, ROLLOUT, torch.zeros(2, 3), rs=True, veto_threshold=1e-4, batch_normalize=True)
    assert float(w.abs().sum()) == 0.0 and float(m.sum()) == 0.0
    assert all(math.isfinite(v) for v in met.values())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"level": "tok"}, "level"),
        ({"mode": "cut"}, "mode"),
        ({"rs": True, "rs_level": "seq"}, "rs_level"),
        ({"level": "geometric", "batch_normalize": True}, "batch_normalize"),
        ({"lower": 3.0, "upper": 2.0}, "lower"),
        ({"upper": 0.0}, "upper"),
        ({"veto_threshold": 0.0}, "veto_threshold"),
        ({"veto_threshold": 1e-6, "veto_rule": "prob"}, "veto_rule"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rollout_correction(OLD, ROLLOUT, MASK, **kwargs)


def test_bad_tensors():
    with pytest.raises(ValueError, match="rollout_logp"):
        rollout_correction(OLD, torch.zeros(2, 4), MASK)
    with pytest.raises(ValueError, match="rollout_logp"):
        rollout_correction(OLD, _t([[0.0, float("nan"), 0.0], [0.0, 0.0, 0.0]]), MASK)
    rollout_correction(OLD, _t([[0.0, 0.0, 0.0], [0.0, 0.0, float("nan")]]), MASK)  # NaN on padding is fine


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from(["token", "sequence", "geometric"]),
    st.sampled_from(["truncate", "clip", "mask"]),
    st.floats(1.01, 10.0),
    st.booleans(),
    st.sampled_from([None, 1e-4, 0.5]),
)
def test_weights_within_bounds(seed, level, mode, upper, rs, veto):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 6
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    old = -3 * torch.rand(B, T, generator=g)
    rollout = old + torch.randn(B, T, generator=g)
    w, m, met = rollout_correction(old, rollout, mask, level=level, mode=mode, upper=upper, rs=rs, veto_threshold=veto)
    lo = 1 / upper
    assert torch.isfinite(w).all() and float(w[mask == 0].abs().sum()) == 0.0
    assert bool(((m == 0) | (mask == 1)).all())  # the mask only ever shrinks
    valid, kept = mask.bool(), m.bool()
    if mode == "truncate":
        assert bool((w[valid] <= upper + 1e-5).all())
    if mode == "clip":
        assert bool(((w[valid] >= lo - 1e-6) & (w[valid] <= upper + 1e-5)).all())
    if mode == "mask" or rs:
        assert bool(((w[kept] >= lo - 1e-6) & (w[kept] <= upper + 1e-5)).all())
    for v in met.values():
        assert math.isfinite(v)
