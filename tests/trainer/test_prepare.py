"""A step's algorithm on the driver (verl_async/trainer/prepare.py) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from trainer_helpers import make_batch

from verl_async.trainer.prepare import StepAlgorithm, correction_inputs, next_kl_coef, prepare_batch, step_advantages
from verl_async.trainer.settings import RolloutCorrectionSettings

LOG3 = math.log(3.0)


def algorithm(**overrides) -> StepAlgorithm:
    base = dict(recompute_old_log_probs=True, use_reference=False, use_kl_in_reward=False, kl_penalty="kl",
                kl_ctrl_type="fixed", target_kl=0.1, kl_horizon=20, adv_estimator="grpo",
                norm_adv_by_std_in_grpo=False, gamma=1.0, correction=RolloutCorrectionSettings())
    return StepAlgorithm(**{**base, **overrides})


# --------------------------------------------------------------------------- rollout correction
def _two_tokens():
    """One row, two valid tokens and a pad; pi_old / pi_rollout = 3 on the first token, 1 on the second."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    old = torch.tensor([[-0.1, -1.0, 0.0]])
    rollout = torch.tensor([[-0.1 - LOG3, -1.0, 0.0]])
    return old, rollout, mask


def test_correction_on_truncates_the_weights_and_keeps_the_mask():
    old, rollout, mask = _two_tokens()
    tensors, metrics = correction_inputs(old, rollout, mask, RolloutCorrectionSettings(enable=True, upper=2.0))
    assert torch.allclose(tensors["is_weights"], torch.tensor([[2.0, 1.0, 0.0]]))  # min(3, 2), min(1, 2), pad 0
    assert torch.equal(tensors["loss_mask"], mask)
    assert metrics["mismatch/truncate_frac"] == pytest.approx(0.5)
    assert metrics["mismatch/train_rollout_logprob_abs_diff"] == pytest.approx(LOG3 / 2)


def test_correction_in_mask_mode_drops_the_token_outside_the_bounds():
    old, rollout, mask = _two_tokens()
    tensors, metrics = correction_inputs(old, rollout, mask,
                                         RolloutCorrectionSettings(enable=True, mode="mask", upper=2.0))
    assert torch.equal(tensors["loss_mask"], torch.tensor([[0.0, 1.0, 0.0]]))  # w=3 is outside [1/2, 2]
    assert metrics["mismatch/mask_frac"] == pytest.approx(0.5)


def test_correction_off_reports_the_mismatch_but_trains_on_the_response_mask():
    old, rollout, mask = _two_tokens()
    tensors, metrics = correction_inputs(old, rollout, mask, RolloutCorrectionSettings(enable=False))
    assert set(tensors) == {"loss_mask"} and torch.equal(tensors["loss_mask"], mask)
    assert metrics["mismatch/train_rollout_logprob_abs_diff"] == pytest.approx(LOG3 / 2)


def test_bypass_mode_has_no_correction_and_no_metrics():
    old, _, mask = _two_tokens()
    tensors, metrics = correction_inputs(old, None, mask, RolloutCorrectionSettings(enable=True))
    assert set(tensors) == {"loss_mask"} and torch.equal(tensors["loss_mask"], mask) and metrics == {}


# --------------------------------------------------------------------------- advantages and in-reward KL
def _scores():
    """Two groups of two; row 1 has one valid token, the others two."""
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    group_index = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    return scores, group_index, mask


def test_grpo_advantages_without_std_are_the_scores_minus_the_group_mean():
    scores, group_index, mask = _scores()
    old = torch.zeros(4, 2)
    adv, metrics, coef = step_advantages(algorithm(), scores, group_index, mask, old, None, kl_coef=0.1)
    expected = torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert torch.allclose(adv, expected)
    assert metrics == pytest.approx({"critic/advantages/mean": (1.0 - 0.5) / 7, "critic/advantages/max": 0.5,
                                     "critic/advantages/min": -0.5})
    assert coef == 0.1


@pytest.mark.parametrize("kind, next_coef", [("fixed", 0.1), ("adaptive", 0.1 * (1 + 0.2 * 4 / 20))])
def test_kl_in_reward_shapes_the_scores_and_moves_the_coefficient(kind, next_coef):
    scores, group_index, mask = _scores()
    old = -torch.ones(4, 2) * mask
    ref = old - 0.5 * mask  # k1 KL 0.5 per valid token
    algo = algorithm(use_reference=True, use_kl_in_reward=True, kl_ctrl_type=kind)
    adv, metrics, coef = step_advantages(algo, scores, group_index, mask, old, ref, kl_coef=0.1)
    # shaped scores: 1 - 0.1*0.5*2 = 0.9 and 0 - 0.1*0.5*1 = -0.05 (mean 0.425); group 1: 0.9, 0.9
    assert torch.allclose(adv[:2], torch.tensor([[0.475, 0.475], [-0.475, 0.0]]))
    assert torch.allclose(adv[2:], torch.zeros(2, 2), atol=1e-7)
    assert metrics["critic/kl_in_reward"] == pytest.approx(0.5)
    assert metrics["critic/kl_in_reward_coef"] == 0.1
    # adaptive: error clip(0.5 / 0.1 - 1, -0.2, 0.2) = 0.2, 4 rows, horizon 20
    assert coef == pytest.approx(next_coef)
    assert next_kl_coef(kind, 0.1, 0.5, target_kl=0.1, horizon=20, n_steps=4) == pytest.approx(next_coef)


# --------------------------------------------------------------------------- the whole preparation
GAP = 0.1


class ForwardPasses:
    """Old log-probs = rollout - GAP, reference = rollout - 2 GAP; counts the forwards."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def compute_log_prob(self, batch, calculate_entropy=False):
        self.calls.append("old")
        old = batch["rollout_log_probs"] - GAP * batch["response_mask"]
        return old, torch.ones_like(old)

    def compute_ref_log_prob(self, batch):
        self.calls.append("ref")
        return batch["rollout_log_probs"] - 2 * GAP * batch["response_mask"]


def test_recomputed_step_holds_every_key_update_needs():
    batch = make_batch(groups=2, n=2, seed=1, empty_response_rows=1)
    mask = batch["response_mask"]
    passes = ForwardPasses()
    algo = algorithm(use_reference=True, correction=RolloutCorrectionSettings(enable=True))
    metrics, coef = prepare_batch(batch, algo, passes, kl_coef=0.2)
    assert passes.calls == ["old", "ref"] and coef == 0.2
    assert torch.allclose(batch["old_log_probs"], batch["rollout_log_probs"] - GAP * mask)
    assert torch.allclose(batch["is_weights"], math.exp(-GAP) * mask)  # pi_old / pi_rollout = e^-GAP, untruncated
    assert torch.equal(batch["loss_mask"], mask.float())
    assert metrics["actor/entropy"] == pytest.approx(1.0)
    assert metrics["actor/ref_kl_of_old"] == pytest.approx(GAP)
    assert metrics["mismatch/train_rollout_logprob_abs_diff"] == pytest.approx(GAP, rel=1e-5)
    assert metrics["mismatch/train_rollout_logprob_abs_diff_max"] == pytest.approx(GAP, rel=1e-5)
    assert {"advantages", "ref_log_prob"} <= set(batch.keys())


class StaleTokensOnly(ForwardPasses):
    """Recomputes exactly the rollout's log-probs on tokens of version 1 and GAP lower on older ones:
    what true on-policy mode gives in a fully async run where the trainer holds version 1."""

    def compute_log_prob(self, batch, calculate_entropy=False):
        stale = (batch["token_versions"] == 0) & batch["response_mask"].bool()
        old = batch["rollout_log_probs"] - GAP * stale
        return old, torch.ones_like(old)


def test_same_version_metrics_separate_the_kernels_gap_from_policy_drift():
    batch = make_batch(groups=2, n=2, seed=3, response_len=(4, 6))
    mask = batch["response_mask"].bool()
    versions = torch.where(mask, torch.ones_like(batch["token_versions"]), batch["token_versions"])
    versions[0, :2] = 0  # two tokens of row 0 were sampled by version 0, the rest by version 1
    batch["token_versions"] = versions
    metrics, _ = prepare_batch(batch, algorithm(), StaleTokensOnly(), kl_coef=0.0, version=1)
    assert metrics["mismatch/train_rollout_logprob_abs_diff_max"] == pytest.approx(GAP)
    assert metrics["mismatch/train_rollout_logprob_abs_diff"] == pytest.approx(2 * GAP / int(mask.sum()))
    assert metrics["mismatch/same_version_logprob_abs_diff_max"] == 0.0
    assert metrics["mismatch/same_version_logprob_abs_diff"] == 0.0
    assert metrics["mismatch/same_version_token_frac"] == pytest.approx(1 - 2 / int(mask.sum()))
    # the correction's view: weights != 1 only on the two stale tokens (default: token-level truncation)
    assert metrics["mismatch/same_version_weight_dev_max"] == 0.0
    assert metrics["mismatch/weight_min"] == pytest.approx(float(torch.exp(torch.tensor(-GAP))))


def test_same_version_metrics_are_absent_when_no_token_has_the_trainers_version():
    batch = make_batch(groups=2, n=2, seed=3)  # every token of version 0
    metrics, _ = prepare_batch(batch, algorithm(), ForwardPasses(), kl_coef=0.0, version=2)
    assert metrics["mismatch/same_version_token_frac"] == 0.0
    assert "mismatch/same_version_logprob_abs_diff_max" not in metrics
    metrics, _ = prepare_batch(make_batch(groups=2, n=2, seed=3), algorithm(), ForwardPasses(), kl_coef=0.0)
    assert not [k for k in metrics if "same_version" in k]  # no version given: not split


def test_no_token_is_of_the_trainers_version_after_a_local_update():
    """trigger_parameter_sync_step > 1: the second step of a sync window recomputes with weights one optimizer
    step past the pushed version 0, which every token carries; none of them was sampled by those weights."""
    batch = make_batch(groups=2, n=2, seed=3)  # every token of version 0
    metrics, _ = prepare_batch(batch, algorithm(), ForwardPasses(), kl_coef=0.0, version=0, local_updates=0)
    assert metrics["mismatch/same_version_token_frac"] == 1.0
    metrics, _ = prepare_batch(make_batch(groups=2, n=2, seed=3), algorithm(), ForwardPasses(), kl_coef=0.0,
                               version=0, local_updates=1)
    assert metrics["mismatch/same_version_token_frac"] == 0.0
    assert "mismatch/same_version_logprob_abs_diff_max" not in metrics


def test_bypass_step_uses_the_rollout_log_probs_and_the_response_mask():
    batch = make_batch(groups=2, n=2, seed=2)
    passes = ForwardPasses()
    algo = algorithm(recompute_old_log_probs=False)
    metrics, _ = prepare_batch(batch, algo, passes, kl_coef=0.0)
    assert passes.calls == []
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    assert torch.equal(batch["loss_mask"], batch["response_mask"].float()) and "is_weights" not in batch.keys()
    assert not [k for k in metrics if k.startswith("mismatch/")]
