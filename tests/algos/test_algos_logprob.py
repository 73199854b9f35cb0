"""Chunked log-prob / entropy: hand values, agreement with the naive version, gradients, memory."""

import math

import pytest
import torch

from verl_async.algos import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from verl_async.algos.logprob import reference_logprobs_and_entropy


def test_hand_values():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    labels = torch.tensor([1, 0])
    z = math.exp(2) + 3
    logp, ent = logprobs_and_entropy(logits, labels, chunk_size=1)
    torch.testing.assert_close(logp, torch.tensor([math.log(0.25), 2 - math.log(z)]))
    p = torch.tensor([math.exp(2), 1, 1, 1]) / z
    torch.testing.assert_close(ent, torch.tensor([math.log(4), float(-(p * p.log()).sum())]))
    # temperature 2 halves the logits; 0 and None mean 1
    torch.testing.assert_close(logprobs_from_logits(logits, labels, temperature=2.0)[1], torch.tensor(1 - math.log(math.e + 3)))
    for t in (0, 0.0, None):
        torch.testing.assert_close(logprobs_from_logits(logits, labels, temperature=t), logp)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("chunk", [1, 7, 1000, None])
def test_matches_naive_values_and_grads(dtype, tol, chunk):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 11, 97, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, 97, (3, 11), generator=g)
    lp, ent = logprobs_and_entropy(logits, labels, temperature=0.7, chunk_size=chunk)
    rlp, rent = reference_logprobs_and_entropy(logits, labels, temperature=0.7)
    assert lp.dtype == torch.promote_types(dtype, torch.float32) and lp.shape == (3, 11)
    torch.testing.assert_close(lp, rlp, atol=tol, rtol=tol)
    torch.testing.assert_close(ent, rent, atol=tol, rtol=tol)
    wl, we = torch.randn(3, 11, generator=g, dtype=lp.dtype), torch.randn(3, 11, generator=g, dtype=lp.dtype)
    (g1,) = torch.autograd.grad((lp * wl).sum() + (ent * we).sum(), logits)
    (g2,) = torch.autograd.grad((rlp * wl).sum() + (rent * we).sum(), logits)
    assert g1.dtype == dtype
    torch.testing.assert_close(g1.double(), g2.double(), atol=max(tol, 1e-2 if dtype == torch.bfloat16 else tol), rtol=1e-2)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda z: logprobs_from_logits(z, labels, 1.3, chunk_size=2), (x,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, chunk_size=4, temperature=0.6), (x,))
    assert torch.autograd.gradcheck(lambda z: logprobs_and_entropy(z, labels, chunk_size=5), (x,))
    # only one output used: the other gradient branch is skipped, result unchanged
    assert torch.autograd.gradcheck(lambda z: logprobs_and_entropy(z, labels, chunk_size=5)[1], (x,))


def test_masked_vocab_gives_no_nan():
    logits = torch.randn(4, 10)
    logits[:, :3] = float("-inf")
    logits.requires_grad_()
    lp, ent = logprobs_and_entropy(logits, torch.tensor([5, 6, 7, 8]), chunk_size=3)
    ref = torch.log_softmax(logits.detach()[:, 3:], -1)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(logits.grad).all() and float(logits.grad[:, :3].abs().sum()) == 0.0


def test_saved_memory_is_bounded():
    """Autograd keeps the bf16 logits and O(N) vectors, never an N x V float32 copy."""
    logits = torch.randn(64, 512).bfloat16().requires_grad_()
    labels = torch.randint(0, 512, (64,))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = logprobs_and_entropy(logits, labels, chunk_size=8)
    logits_bytes = logits.numel() * logits.element_size()
    assert sum(saved) <= logits_bytes + 64 * 8 * 4
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        saved.clear()
        reference_logprobs_and_entropy(logits, labels)
    assert sum(saved) >= 64 * 512 * 4  # the naive version keeps a float32 N x V


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: logprobs_from_logits(torch.zeros(2, 5), torch.tensor([0, 5])), "labels"),
        (lambda: logprobs_from_logits(torch.zeros(2, 5), torch.tensor([0])), "labels"),
        (lambda: logprobs_from_logits(torch.zeros(2, 5), torch.tensor([0.0, 1.0])), "labels"),
        (lambda: logprobs_from_logits(torch.zeros(2, 5), torch.tensor([0, 1]), temperature=-1.0), "temperature"),
        (lambda: entropy_from_logits(torch.zeros(2, 5), chunk_size=0), "chunk_size"),
        (lambda: entropy_from_logits(torch.zeros(2, 5, dtype=torch.long)), "logits"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
