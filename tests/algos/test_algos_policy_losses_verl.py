"""verl 0.9.1's policy losses as the oracle: every `policy_loss.loss_mode` of verl_async.algos.policy_losses
gives verl's loss, gradient and metrics on the same random tensors, for every loss_agg_mode, with and
without rollout-correction weights, with and without the global normalisers, masks with holes (multi-turn
tool tokens) and empty rows.

verl is a test-only oracle: scripts/setup.sh installs verl==0.9.1 with --no-deps (its own pins would
move transformers), plus the two small packages `verl.trainer.ppo.core_algos` imports beyond ours.
"""

from __future__ import annotations

import pytest
import torch

from verl_async.algos import LOSS_AGG_MODES
from verl_async.algos.policy_losses import POLICY_LOSSES, compute_policy_loss, loss_keys
from verl_async.algos.rollout_rejection import is_weights, parse_rejection, rejection_mask

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos",
                                 reason="verl 0.9.1 (the oracle) is not installed: bash scripts/setup.sh installs it")
verl_config = pytest.importorskip("verl.workers.config")
verl_algo_config = pytest.importorskip("verl.trainer.config.algorithm")
rollout_corr_helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")

VERL_MODES = ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo", "dppo_tv",
              "dppo_kl", "bypass_mode")
# the keys of each loss, as non-default values (so a key that is not passed shows)
PARAMS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.2, tau_neg=1.5,
              clip_cov_ratio=0.05, clip_cov_lb=0.5, clip_cov_ub=4.0, kl_cov_ratio=0.05, ppo_kl_coef=0.3,
              dro_beta=0.2)
BYPASS = [
    dict(loss_type="ppo_clip"),
    dict(loss_type="ppo_clip", rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4"),
    dict(loss_type="ppo_clip", rollout_rs="seq_mean_k3,seq_max_k2", rollout_rs_threshold="0.05,0.3"),
    dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1",
         rollout_rs_threshold=3.0),
    dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.8_1.5", rollout_rs="token_k2",
         rollout_rs_threshold=0.08),
]


def verl_actor(mode: str, correction: dict | None = None, global_info: dict | None = None):
    rc = verl_algo_config.RolloutCorrectionConfig(**{"rollout_is": None, **(correction or {})})
    policy = verl_config.PolicyLossConfig(
        loss_mode=mode, clip_cov_ratio=PARAMS["clip_cov_ratio"], clip_cov_lb=PARAMS["clip_cov_lb"],
        clip_cov_ub=PARAMS["clip_cov_ub"], kl_cov_ratio=PARAMS["kl_cov_ratio"], ppo_kl_coef=PARAMS["ppo_kl_coef"],
        dro_beta=PARAMS["dro_beta"], rollout_correction=rc)
    actor = verl_config.ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
        clip_ratio_low=PARAMS["clip_ratio_low"], clip_ratio_high=PARAMS["clip_ratio_high"],
        clip_ratio_c=PARAMS["clip_ratio_c"], tau_pos=PARAMS["tau_pos"], tau_neg=PARAMS["tau_neg"], policy_loss=policy)
    actor.global_batch_info.update(global_info or {})
    return actor


def batch(seed: int, B: int = 6, T: int = 9):
    """Log-probs around -1.5, the old ones 0.3 nats off (ratios across the clip bounds; one row 1.5 nats off,
    past the dual clip and the DPPO trust regions), a mask with a tool-token hole, a short row and an empty row."""
    g = torch.Generator().manual_seed(seed)
    logp = -3.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    old[4] = logp[4] + 1.5 * torch.randn(T, generator=g, dtype=torch.float64)  # far off: dual clip, trust regions
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    adv[0] = torch.randn(T, generator=g, dtype=torch.float64)  # one row with token-level advantages
    weights = 0.5 + torch.rand(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:6] = False  # tool tokens inside a response
    mask[2, 4:] = False
    mask[3] = False  # a response whose every token is masked
    return logp, old, adv, mask, weights


def ours(mode, logp, old, adv, mask, *, agg, weights, correction=None, norm=None):
    x = logp.clone().requires_grad_()
    params = {**PARAMS, **(correction or {})}
    loss, metrics = compute_policy_loss(mode, x, old, adv, mask.double(), params=params, loss_agg_mode=agg,
                                        is_weights=weights, **(norm or {}))
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, metrics


def theirs(mode, logp, old, adv, mask, *, agg, weights, correction=None, global_info=None):
    x = logp.clone().requires_grad_()
    fn = core_algos.get_policy_loss_fn(mode)
    loss, metrics = fn(old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask, loss_agg_mode=agg,
                       config=verl_actor(mode, correction, global_info), rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, metrics


def assert_same(mine, verl, mode):
    loss, grad, metrics = mine
    v_loss, v_grad, v_metrics = verl
    torch.testing.assert_close(loss, v_loss, rtol=1e-6, atol=1e-9, msg=lambda m: f"{mode} loss: {m}")
    torch.testing.assert_close(grad, v_grad, rtol=1e-6, atol=1e-9, msg=lambda m: f"{mode} gradient: {m}")
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        if f"actor/{key}" in v_metrics:
            assert metrics[key] == pytest.approx(v_metrics[f"actor/{key}"], rel=1e-6, abs=1e-9), (mode, key)


def test_the_registry_holds_verls_losses():
    assert set(POLICY_LOSSES) == set(core_algos.POLICY_LOSS_REGISTRY) == set(VERL_MODES)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", [m for m in VERL_MODES if m != "bypass_mode"])
def test_each_loss_equals_verls(mode, agg):
    for seed, with_weights in ((0, False), (1, True), (2, True)):
        logp, old, adv, mask, w = batch(seed)
        w = w if with_weights else None
        torch.manual_seed(seed)  # clip_cov draws its tokens from the global generator, as verl's does
        mine = ours(mode, logp, old, adv, mask, agg=agg, weights=w)
        torch.manual_seed(seed)
        assert_same(mine, theirs(mode, logp, old, adv, mask, agg=agg, weights=w), mode)


@pytest.mark.parametrize("mode", [m for m in VERL_MODES if m not in ("bypass_mode", "geo_mean")])
def test_global_normalisers_equal_verls_global_batch_info(mode):
    """A micro-batch's share: our global_* are verl's batch_num_tokens / global_batch_size / loss_scale_factor."""
    logp, old, adv, mask, w = batch(5)
    for agg in LOSS_AGG_MODES:
        norm = dict(global_tokens=97, global_seqs=13, loss_scale_factor=20)
        info = dict(dp_size=1, batch_num_tokens=97, global_batch_size=13, loss_scale_factor=20)
        torch.manual_seed(0)
        mine = ours(mode, logp, old, adv, mask, agg=agg, weights=w, norm=norm)
        torch.manual_seed(0)
        assert_same(mine, theirs(mode, logp, old, adv, mask, agg=agg, weights=w, global_info=info), mode)


@pytest.mark.parametrize("correction", BYPASS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_bypass_mode_equals_verls(correction, agg):
    for seed in (3, 4):
        logp, old, adv, mask, _ = batch(seed)
        mine = ours("bypass_mode", logp, old, adv, mask, agg=agg, weights=None, correction=correction)
        verl = theirs("bypass_mode", logp, old, adv, mask, agg=agg, weights=None, correction=correction)
        assert_same(mine, verl, f"bypass_mode {correction}")
        if "rollout_rs" in correction:
            dropped = mine[2]["rollout_rs_masked_fraction"]
            assert 0 < dropped < 1 and dropped == pytest.approx(verl[2]["rollout_corr/rollout_rs_masked_fraction"])


@pytest.mark.parametrize("options,threshold", [
    ("token_k1", 2.0), ("token_k1", "0.5_1.2"), ("token_k2", 0.05), ("token_k3", "0.1"), ("seq_sum_k1", "0.2_3"),
    ("seq_sum_k2", 0.5), ("seq_sum_k3", 0.5), ("seq_mean_k1", 1.3), ("seq_mean_k2", 0.05), ("seq_mean_k3", 0.06),
    ("seq_max_k2", 0.2), ("seq_max_k3", 0.2), ("token_k1,seq_mean_k3", "0.6_1.6,0.1")])
def test_rejection_and_weights_equal_verls(options, threshold):
    logp, old, _, mask, _ = batch(7)
    log_ratio = logp - old
    keep, _ = rejection_mask(log_ratio, mask.double(), parse_rejection(options, threshold))
    v_keep, _ = rollout_corr_helper.compute_rollout_rejection_mask(log_ratio, mask.double(), options, threshold)
    assert torch.equal(keep, v_keep) and 0 < int(keep.sum()) < int(mask.sum())  # some kept, some dropped
    for level, spec, normalize in (("token", 2.0, False), ("sequence", 1.5, True), ("token", "0.8_1.3", True)):
        from verl_async.algos.rollout_rejection import parse_is_threshold

        lower, upper = parse_is_threshold(spec)
        mine = is_weights(log_ratio, mask.double(), level, lower, upper, normalize)
        theirs_w, _ = rollout_corr_helper.compute_rollout_correction_weights(log_ratio, mask.double(), level, spec,
                                                                             normalize)
        torch.testing.assert_close(mine, theirs_w)


def test_loss_keys_are_verls_names():
    assert loss_keys("gspo") == ("clip_ratio_low", "clip_ratio_high")
    assert loss_keys("sapo") == ("tau_pos", "tau_neg")
    assert loss_keys("dro") == ("dro_beta",)
    assert set(loss_keys("bypass_mode")) >= {"loss_type", "rollout_is", "rollout_rs", "rollout_rs_threshold"}
