"""verl_async.invariant's kernels one by one: the same math as the plain ops (close), and a row's bits do
not depend on the rows it is computed with (equal); gradients are those of the plain ops. The invariance
tests run on CPU (float32, bf16) and, with `-m gpu`, on CUDA (bf16): the probes of the CUDA shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verl_async.invariant.attention import _reference, canonical_attention
from verl_async.invariant.logprob import sampled_logprobs, token_logprobs
from verl_async.invariant.ops import linear, map_rows, rms_norm, silu
from verl_async.invariant.shapes import environment_problem, shapes_for

DTYPES = [torch.float32, torch.bfloat16]
CASES = [pytest.param("cpu", torch.float32, id="cpu-float32"), pytest.param("cpu", torch.bfloat16, id="cpu-bfloat16"),
         pytest.param("cuda", torch.bfloat16, id="cuda-bfloat16", marks=pytest.mark.gpu)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _companions(x: torch.Tensor, row: int, n: int, seed: int) -> torch.Tensor:
    """`x[row]` placed at a random position among n - 1 random rows; returns (batch, position)."""
    gen = torch.Generator().manual_seed(seed)
    batch = torch.randn((n, *x.shape[1:]), generator=gen).to(device=x.device, dtype=x.dtype)
    pos = int(torch.randint(n, (1,), generator=gen))
    batch[pos] = x[row]
    return batch, pos


def _same_gradients(ours: torch.Tensor, plain: torch.Tensor, inputs: tuple, grad: torch.Tensor) -> None:
    for a, p in zip(torch.autograd.grad(ours, inputs, grad), torch.autograd.grad(plain, inputs, grad)):
        torch.testing.assert_close(a, p)


def test_map_rows_pads_and_drops_the_padding():
    x = torch.arange(10.0).view(5, 2)
    seen = []
    out = map_rows(lambda t: (seen.append(t.shape[0]), t * 2)[1], x, 4)
    assert torch.equal(out, x * 2) and seen == [4, 4]
    seen.clear()
    assert torch.equal(map_rows(lambda t: (seen.append(t.shape[0]), t + 1)[1], x[:1], None), x[:1] + 1)
    assert seen == [2]  # one row goes out as two


@pytest.mark.parametrize("device, dtype", CASES)
def test_linear_rows_do_not_depend_on_their_batch(device, dtype):
    torch.manual_seed(0)
    w = (torch.randn(384, 1536) * 0.03).to(device, dtype)
    b = torch.randn(384).to(device, dtype)
    x = torch.randn(3, 1536).to(device, dtype)
    rows = shapes_for(device, dtype).linear_rows
    ref = linear(x[1:2], w, b, rows)[0]
    torch.testing.assert_close(ref, F.linear(x[1:2], w, b)[0], atol=TOL[dtype], rtol=TOL[dtype])
    for n, seed in ((2, 1), (7, 2), ((rows or 64) + 5, 3), (3 * (rows or 64), 4), (700, 5)):
        batch, pos = _companions(x, 1, n, seed)
        assert torch.equal(linear(batch, w, b, rows)[pos], ref), n


def test_cpu_float32_gemm_rows_do_not_depend_on_the_row_count():
    """The ground for `linear_rows=None` on CPU float32 (shapes.py): MKL in strict CNR mode (the test
    environment's MKL_CBWR, tests/conftest.py) gives a row the same bits in a GEMM of any row count and
    any thread count; the plain GEMM would be refused here if it did not."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for k, n in ((64, 264), (576, 1536), (1536, 576), (576, 4096)):
            w, b = torch.randn(n, k) * 0.05, torch.randn(n)
            x = torch.randn(1100, k)
            ref = torch.addmm(b, x[5:6], w.t())[0]
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                for m in (2, 3, 8, 17, 64, 300, 1100):
                    assert torch.equal(torch.addmm(b, x[:m], w.t())[5 if m > 5 else 0] if m > 5 else
                                       torch.addmm(b, x[5 : 5 + m], w.t())[0], ref), (k, n, t, m)
    finally:
        torch.set_num_threads(threads)


def test_linear_gradient_is_f_linear_s():
    torch.manual_seed(0)
    x = torch.randn(2, 70, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    _same_gradients(linear(x, w, b, 64), F.linear(x, w, b), (x, w, b), torch.randn(2, 70, 8))


@pytest.mark.parametrize("device, dtype", CASES)
def test_rms_norm_and_silu_rows_do_not_depend_on_their_batch(device, dtype):
    torch.manual_seed(0)
    x = (torch.randn(4, 576) * 3).to(device, dtype)
    weight = torch.rand(576).to(device, dtype)
    reduce_rows = shapes_for(device).reduce_rows
    ref = rms_norm(x[2:3], weight, 1e-6, reduce_rows)[0]
    h = x[2:3].float()
    plain = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(ref, plain[0], atol=TOL[dtype], rtol=TOL[dtype])
    for n, seed in ((2, 1), (33, 2), (300, 3)):
        batch, pos = _companions(x, 2, n, seed)
        assert torch.equal(rms_norm(batch, weight, 1e-6, reduce_rows)[pos], ref)
        assert torch.equal(silu(batch)[pos], silu(x[2:3])[0])
    torch.testing.assert_close(silu(x), F.silu(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("device, dtype", CASES)
def test_attention_of_a_sequence_does_not_depend_on_the_others(device, dtype):
    """Sequence 0 alone, in a batch of three, and as one decode query: the same outputs; close to SDPA."""
    torch.manual_seed(0)
    S, G, R, L, D, span = 3, 2, 2, 37, 16, 64
    q = torch.randn(S, G, R, L, D).to(device, dtype)
    k = torch.zeros(S, G, span, D).to(device, dtype)
    v = torch.zeros(S, G, span, D).to(device, dtype)
    k[:, :, :L] = torch.randn(S, G, L, D).to(device, dtype)
    v[:, :, :L] = torch.randn(S, G, L, D).to(device, dtype)
    pos = torch.arange(L, device=device).expand(S, L)
    together = canonical_attention(q, k, v, pos, scale=D ** -0.5)
    alone = canonical_attention(q[:1], k[:1], v[:1], pos[:1], scale=D ** -0.5)
    assert torch.equal(together[:1], alone)
    t = 20  # position 20 as a decode step: one query, the cache holds keys past it too (masked)
    decode = canonical_attention(q[:1, :, :, t : t + 1], k[:1], v[:1], torch.tensor([[t]], device=device),
                                 scale=D ** -0.5)
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
    _same_gradients(canonical_attention(q, k, v, pos, scale=0.3), _reference(q, k, v, pos, 0.3, None), (q, k, v),
                    torch.randn(S, G, R, L, D))


@pytest.mark.parametrize("device, dtype", CASES)
def test_token_log_probs_of_a_row_do_not_depend_on_the_others(device, dtype):
    torch.manual_seed(0)
    logits = (torch.randn(40, 49152) * 4).to(device, dtype)
    tokens = torch.randint(49152, (40,)).to(device)
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
