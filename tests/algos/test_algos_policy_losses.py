"""verl 0.9's policy losses (verl_async.algos.policy_losses) on hand-computed values, masks and bad input.

Oracle equality with verl's own functions: test_algos_policy_losses_verl.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl_async.algos.policy_losses import POLICY_LOSSES, compute_policy_loss, loss_keys

PARAMS = dict(dro_beta=0.5, clip_cov_ratio=0.5, clip_cov_lb=-10.0, clip_cov_ub=10.0, kl_cov_ratio=0.5,
              ppo_kl_coef=1.0, rollout_rs="token_k1", rollout_rs_threshold=2.0)


def run(mode, logp, old, adv, mask, **kw):
    params = {**PARAMS, **kw.pop("params", {})}
    return compute_policy_loss(mode, logp, old, adv, mask, params=params, **kw)


def test_hand_values():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    old = torch.log(torch.tensor([[0.25, 0.25]]))  # ratios 2 and 1
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    # gpg: mean of -A log pi
    assert float(run("gpg", logp, old, adv, mask)[0]) == pytest.approx((-math.log(0.5) + math.log(0.25)) / 2)
    # dro: -(A log pi - beta/2 (log r)^2), beta 0.5
    dro = (-(math.log(0.5) - 0.25 * math.log(2) ** 2) - (-math.log(0.25))) / 2
    assert float(run("dro", logp, old, adv, mask)[0]) == pytest.approx(dro)
    # cispo: -sg(clip(r, 0.8, 1.28)) A log pi: token 1 clipped to 1.28
    loss, m = run("cispo", logp, old, adv, mask, params=dict(clip_ratio_high=0.28))
    assert float(loss) == pytest.approx((-1.28 * math.log(0.5) + math.log(0.25)) / 2) and m["pg_clipfrac"] == 0.5
    # sapo: gate(1) = sigmoid(0) 4 / tau = 2 / tau; gate(2) = sigmoid(tau) 4 / tau; seq-mean-token-mean
    sapo = (-(1 / (1 + math.exp(-1.0))) * 4 + 2 / 1.05) / 2
    assert float(run("sapo", logp, old, adv, mask)[0]) == pytest.approx(sapo)
    # gspo: one sequence, s = exp(mean log r) = sqrt 2 for both tokens; A>0 clipped at 1.2, A<0: -(-1) * sqrt2
    assert float(run("gspo", logp, old, adv, mask)[0]) == pytest.approx((-1.2 + math.sqrt(2)) / 2)


def test_geo_mean_hand_value_and_empty_rows():
    # one row, A = 1: log r = [0.1, 0.5] clipped on A's side at +0.2 -> mean(0.1, 0.2); loss -exp(0.15)
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.1, 0.5], [0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    loss, m = run("geo_mean", logp, old, adv, mask)
    assert float(loss) == pytest.approx(-math.exp(0.15) / 2)  # verl's mean counts the empty row
    assert float(run("geo_mean", logp, old, adv, mask, global_seqs=1)[0]) == pytest.approx(-math.exp(0.15))
    assert m["pg_clipfrac"] == 0.5


@pytest.mark.parametrize("mode", sorted(POLICY_LOSSES))
def test_masked_positions_hold_anything_and_get_no_gradient(mode):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g)
    logp = (old + 0.2 * torch.randn(3, 5, generator=g)).requires_grad_()
    adv = torch.randn(3, 1, generator=g).expand(3, 5).contiguous()
    mask = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float32)
    poisoned_old = torch.where(mask.bool(), old, torch.tensor(float("nan")))
    torch.manual_seed(1)
    loss, metrics = run(mode, logp, poisoned_old, adv, mask)
    loss.backward()
    assert math.isfinite(float(loss.detach())) and all(math.isfinite(v) for v in metrics.values())
    assert float(logp.grad[mask == 0].abs().max()) == 0.0
    assert float(logp.grad[mask == 1].abs().max()) > 0.0


def test_registry_and_errors():
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo",
                                  "dppo_tv", "dppo_kl", "bypass_mode"}
    assert loss_keys("gpg") == ()
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="policy_loss.loss_mode"):
        compute_policy_loss("ppo", x, x, x, torch.ones(1, 2))
    with pytest.raises(ValueError, match="policy_loss.dro_beta"):
        compute_policy_loss("dro", x, x, x, torch.ones(1, 2))
    with pytest.raises(ValueError, match="rollout_correction.loss_type"):
        run("bypass_mode", x, x, x, torch.ones(1, 2), params=dict(loss_type="pg"))
    with pytest.raises(ValueError, match="old_logp"):
        run("gspo", x, torch.tensor([[0.0, float("inf")]]), x, torch.ones(1, 2))


def test_bypass_mode_rejects_against_the_policy_being_trained():
    """log r = log pi - log pi_rollout of the CURRENT policy: a token far from the rollout leaves the loss."""
    old = torch.zeros(1, 3)  # the rollout's log-probs
    logp = torch.tensor([[0.0, 0.1, 2.0]], requires_grad=True)  # r = 1, e^0.1, e^2 (> 2: rejected)
    adv = torch.ones(1, 3)
    loss, m = run("bypass_mode", logp, old, adv, torch.ones(1, 3), params=dict(clip_ratio_high=0.28))
    assert m["rollout_rs_masked_fraction"] == pytest.approx(1 / 3)
    # ppo_clip on the kept tokens: on its own the batch counts the kept ones, as verl without global counts ...
    assert float(loss.detach()) == pytest.approx((-1.0 - math.exp(0.1)) / 2)
    loss.backward()
    assert float(logp.grad[0, 2]) == 0.0
    # ... and a micro-batch's share keeps the mini-batch's count: a rejected token counts as 0 (verl, #4852)
    loss, _ = run("bypass_mode", logp.detach(), old, adv, torch.ones(1, 3), global_tokens=3)
    assert float(loss) == pytest.approx((-1.0 - math.exp(0.1)) / 3)
    # reinforce with token weights min(r, 2): -w A log pi
    loss, _ = run("bypass_mode", logp.detach(), old, adv, torch.ones(1, 3),
                  params=dict(loss_type="reinforce", rollout_is="token", rollout_rs=None))
    assert float(loss) == pytest.approx((-0.0 - math.exp(0.1) * 0.1 - 2.0 * 2.0) / 3)
