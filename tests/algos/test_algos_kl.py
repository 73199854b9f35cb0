"""KL estimators: hand values, clamps, straight-through gradient, gradcheck."""

import math

import pytest
import torch

from verl_async.algos import KL_KINDS, kl_in_reward, kl_penalty


def test_kl_hand_values():
    logp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, 0.0])  # logp - ref = [1, -1]
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5, 0.5]))
    k3 = torch.tensor([math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1])  # exp(ref-logp) - (ref-logp) - 1
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), k3)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), k3)


def test_k3_clamps():
    logp = torch.tensor([0.0, 0.0, 0.0])
    ref = torch.tensor([30.0, 2.0, -30.0])  # exp(30) would explode; -30 gives 30 - 1 > 10
    out = kl_penalty(logp, ref, "k3")
    torch.testing.assert_close(out, torch.tensor([10.0, math.exp(2) - 2 - 1, 10.0]))


def test_straight_through_gradient_is_k2():
    logp = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.2, 0.1], dtype=torch.float64)
    out = kl_penalty(logp, ref, "k3+")
    torch.testing.assert_close(out.detach(), kl_penalty(logp.detach(), ref, "k3"))
    out.sum().backward()
    torch.testing.assert_close(logp.grad, (logp - ref).detach())


@pytest.mark.parametrize("kind", KL_KINDS)
def test_gradcheck(kind):
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    ref = torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.5
    assert torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, kind.rstrip("+")), (logp,))


def test_kl_in_reward():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    scores = torch.tensor([[0.0, 1.0, 5.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    rewards, mean_kl = kl_in_reward(scores, old, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert mean_kl == pytest.approx(0.5)  # one non-empty sequence, token KLs [1, 0]


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(2), torch.zeros(3), "kl"), "ref_logp"),
        ((torch.zeros(2), torch.zeros(2), "k4"), "kind"),
        ((torch.tensor([float("nan"), 0.0]), torch.zeros(2), "kl"), "logp"),
        ((torch.zeros(2), torch.tensor([0.0, float("-inf")]), "k3"), "ref_logp"),
    ],
)
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        kl_penalty(*args)
