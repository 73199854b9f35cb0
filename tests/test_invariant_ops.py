"""verl_async.invariant's kernels one by one: the same math as the plain ops (close), and a row's bits do
not depend on the rows it is computed with (equal); gradients are those of the plain ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verl_async.invariant.attention import _reference, canonical_attention
from verl_async.invariant.logprob import sampled_logprobs, token_logprobs
from verl_async.invariant.ops import linear, map_rows, rms_norm, silu
from verl_async.invariant.shapes import environment_problem, shapes_for

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _companions(x: torch.Tensor, row: int, n: int, seed: int) -> torch.Tensor:
    """`x[row]` placed at a random position among n - 1 random rows; returns (batch, position)."""
    gen = torch.Generator().manual_seed(seed)
    batch = torch.randn((n, *x.shape[1:]), generator=gen).to(x.dtype)
    pos = int(torch.randint(n, (1,), generator=gen))
    batch[pos] = x[row]
    return batch, pos


def test_map_rows_pads_and_drops_the_padding():
    x = torch.arange(10.0).view(5, 2)
    seen = []
    out = map_rows(lambda t: (seen.append(t.shape[0]), t * 2)[1], x, 4)
    assert torch.equal(out, x * 2) and seen == [4, 4]
    seen.clear()
    assert torch.equal(map_rows(lambda t: (seen.append(t.shape[0]), t + 1)[1], x[:1], None), x[:1] + 1)
    assert seen == [2]  # one row goes out as two


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_their_batch(dtype):
    torch.manual_seed(0)
    w = (torch.randn(384, 1536) * 0.03).to(dtype)
    b = torch.randn(384).to(dtype)
    x = torch.randn(3, 1536).to(dtype)
    rows = shapes_for("cpu").linear_rows
    ref = linear(x[1:2], w, b, rows)[0]
    torch.testing.assert_close(ref, F.linear(x[1:2], w, b)[0], atol=TOL[dtype], rtol=TOL[dtype])
    for n, seed in ((2, 1), (7, 2), (rows + 5, 3), (3 * rows, 4)):
        batch, pos = _companions(x, 1, n, seed)
        assert torch.equal(linear(batch, w, b, rows)[pos], ref), n


def test_linear_gradient_is_f_linear_s():
    torch.manual_seed(0)
    x = torch.randn(2, 70, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    g = torch.randn(2, 70, 8)
    ours = torch.autograd.grad(linear(x, w, b, 64), (x, w, b), g)
    plain = torch.autograd.grad(F.linear(x, w, b), (x, w, b), g)
    for a, p in zip(ours, plain):
        torch.testing.assert_close(a, p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_silu_rows_do_not_depend_on_their_batch(dtype):
    torch.manual_seed(0)
    x = (torch.randn(4, 576) * 3).to(dtype)
    weight = torch.rand(576).to(dtype)
    ref = rms_norm(x[2:3], weight, 1e-6, None)[0]
    h = x[2:3].float()
    plain = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(ref, plain[0], atol=TOL[dtype], rtol=TOL[dtype])
    for n, seed in ((2, 1), (33, 2), (300, 3)):
        batch, pos = _companions(x, 2, n, seed)
        assert torch.equal(rms_norm(batch, weight, 1e-6, None)[pos], ref)
        assert torch.equal(silu(batch)[pos], silu(x[2:3])[0])
    torch.testing.assert_close(silu(x), F.silu(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_of_a_sequence_does_not_depend_on_the_others(dtype):
    """Sequence 0 alone, in a batch of three, and as one decode query: the same outputs; close to SDPA."""
    torch.manual_seed(0)
    S, G, R, L, D, span = 3, 2, 2, 37, 16, 64
    q = torch.randn(S, G, R, L, D).to(dtype)
    k = torch.zeros(S, G, span, D).to(dtype)
    v = torch.zeros(S, G, span, D).to(dtype)
    k[:, :, :L] = torch.randn(S, G, L, D).to(dtype)
    v[:, :, :L] = torch.randn(S, G, L, D).to(dtype)
    pos = torch.arange(L).expand(S, L)
    together = canonical_attention(q, k, v, pos, scale=D ** -0.5)
    alone = canonical_attention(q[:1], k[:1], v[:1], pos[:1], scale=D ** -0.5)
    assert torch.equal(together[:1], alone)
    t = 20  # position 20 as a decode step: one query, the cache holds keys past it too (masked)
    decode = canonical_attention(q[:1, :, :, t : t + 1], k[:1], v[:1], torch.tensor([[t]]), scale=D ** -0.5)
    assert torch.equal(decode[..., 0, :], together[:1, :, :, t])
    ref = _reference(q.float(), k.float(), v.float(), pos, D ** -0.5, None)
    torch.testing.assert_close(together.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    windowed = canonical_attention(q, k, v, pos, scale=D ** -0.5, window=5)
    torch.testing.assert_close(windowed.float(), _reference(q.float(), k.float(), v.float(), pos, D ** -0.5, 5),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_attention_gradient_is_sdpa_s():
    torch.manual_seed(0)
    S, G, R, L, D = 2, 1, 2, 9, 8
    q, k, v = (torch.randn(S, G, n, L, D, requires_grad=True) if n else torch.randn(S, G, L, D, requires_grad=True)
               for n in (R, 0, 0))
    pos = torch.arange(L).expand(S, L)
    g = torch.randn(S, G, R, L, D)
    ours = torch.autograd.grad(canonical_attention(q, k, v, pos, scale=0.3), (q, k, v), g)
    plain = torch.autograd.grad(_reference(q, k, v, pos, 0.3, None), (q, k, v), g)
    for a, p in zip(ours, plain):
        torch.testing.assert_close(a, p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_log_probs_of_a_row_do_not_depend_on_the_others(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(40, 49152) * 4).to(dtype)
    tokens = torch.randint(49152, (40,))
    all_rows = token_logprobs(logits, tokens, 0.7)
    ref = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(all_rows, ref, atol=1e-5, rtol=1e-5)
    for i in (0, 17, 39):
        assert torch.equal(token_logprobs(logits[i : i + 1], tokens[i : i + 1], 0.7)[0], all_rows[i])
    mixed = sampled_logprobs(logits[:3].float(), tokens[:3], [0.7, 0.0, 0.7])  # greedy rows report T = 1
    assert torch.equal(mixed[0], all_rows[0]) and torch.equal(mixed[2], all_rows[2])
    assert torch.equal(mixed[1], token_logprobs(logits[1:2], tokens[1:2], 1.0)[0])


def test_environment_problem_names_the_variable(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    assert "MKL_CBWR=AUTO,STRICT" in environment_problem("cpu")
    monkeypatch.setenv("MKL_CBWR", "AUTO,STRICT")
    assert environment_problem("cpu") is None
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    assert "CUBLASLT_WORKSPACE_SIZE=1" in environment_problem("cuda")
