"""verl_async.invariant's kernels one by one: the same math as the plain ops (close), and a row's bits do
not depend on the rows it is computed with (equal); gradients are those of the plain ops. The invariance
tests run on CPU (float32, bf16) and, with `-m gpu`, on CUDA (bf16): the probes of the CUDA shapes.

On CPU the promise comes from exact sums (verl_async/invariant/exact.py), so the tests also swap the
library that runs the GEMMs (numpy's OpenBLAS, a sequential sum in reverse order) and the thread count:
the bits must not move. Run them under any BLAS setting (e.g. MKL_ENABLE_INSTRUCTIONS=AVX2, MKL_CBWR
unset): nothing here depends on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from verl_async.invariant import exact
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
    rows = shapes_for(device).linear_rows
    ref = linear(x[1:2], w, b, rows)[0]
    torch.testing.assert_close(ref, F.linear(x[1:2], w, b)[0], atol=TOL[dtype], rtol=TOL[dtype])
    for n, seed in ((2, 1), (7, 2), ((rows or 64) + 5, 3), (3 * (rows or 64), 4), (700, 5)):
        batch, pos = _companions(x, 1, n, seed)
        assert torch.equal(linear(batch, w, b, rows)[pos], ref), n


def _openblas_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.matmul(a.numpy(), b.numpy()))


def _reverse_sum_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The products summed one by one from the last k to the first (a GEMM no BLAS would write)."""
    products = a[..., :, :, None] * b[..., None, :, :]  # [.., m, k, n]
    return products.flip(-2).cumsum(-2)[..., -1, :]


LIBRARIES = {"openblas": (_openblas_mm, _openblas_mm), "reverse": (_reverse_sum_mm, _reverse_sum_mm)}


@pytest.mark.parametrize("library", sorted(LIBRARIES))
def test_cpu_linear_and_attention_bits_do_not_depend_on_the_blas_or_the_threads(monkeypatch, library):
    """What the promise rests on (exact sums), checked against another library's GEMM, a reverse-order sum
    and 1-3 threads: the same bits (a plain float32 GEMM differs between these, see the last assertion)."""
    torch.manual_seed(0)
    w, b = torch.randn(48, 200) * 0.05, torch.randn(48)
    x = torch.randn(9, 200) * torch.logspace(-3, 3, 200)  # rows with a wide range of magnitudes
    q, k, v = torch.randn(2, 2, 2, 5, 16), torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)
    pos = torch.arange(5).expand(2, 5) + 7
    expected = linear(x, w, b, None), canonical_attention(q, k, v, pos, scale=0.25)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(linear(x, w, b, None), expected[0])
            assert torch.equal(canonical_attention(q, k, v, pos, scale=0.25), expected[1])
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(exact, "gemm", LIBRARIES[library][0])
    monkeypatch.setattr(exact, "batched_gemm", LIBRARIES[library][1])
    assert torch.equal(linear(x, w, b, None), expected[0])
    assert torch.equal(canonical_attention(q, k, v, pos, scale=0.25), expected[1])
    assert not torch.equal(_reverse_sum_mm(x, w.t()), x @ w.t())  # in float32 the order shows in the bits


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
    if device == "cpu":  # exact sums: the keys past the query can be left out, the span fixes the bit widths
        short = canonical_attention(q[:1, :, :, t : t + 1], k[:1, :, : t + 1], v[:1, :, : t + 1],
                                    torch.tensor([[t]], device=device), scale=D ** -0.5, span=span)
        assert torch.equal(short, decode)
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
    grad = torch.randn(S, G, R, L, D)
    _same_gradients(canonical_attention(q, k, v, pos, scale=0.3), _reference(q, k, v, pos, 0.3, None), (q, k, v), grad)
    # the trainer's layout (queries at 0..L-1 over keys 0..L-1): the backward through SDPA's causal kernel, the same
    # gradient as the masked one, and the same forward bits
    causal = canonical_attention(q, k, v, pos, scale=0.3, causal=True)
    assert torch.equal(causal, canonical_attention(q, k, v, pos, scale=0.3))
    _same_gradients(causal, _reference(q, k, v, pos, 0.3, None), (q, k, v), grad)


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
    """CPU: exact sums, no BLAS setting. CUDA's chunked path (no triton) needs cuBLAS's workspace settings, passed to
    the workers; the Triton kernels need none (no compared value comes from cuBLAS), so none are passed."""
    from verl_async.invariant import triton_ops
    from verl_async.invariant.shapes import PROCESS_ENV, worker_env

    monkeypatch.delenv("MKL_CBWR", raising=False)
    assert environment_problem("cpu") is None
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    monkeypatch.setattr(triton_ops, "use_triton", lambda device: False)
    assert "CUBLASLT_WORKSPACE_SIZE=1" in environment_problem("cuda") and "install triton" in environment_problem("cuda")
    assert worker_env("cuda") == PROCESS_ENV
    monkeypatch.setattr(triton_ops, "use_triton", lambda device: device.type == "cuda")
    assert environment_problem("cuda") is None and worker_env("cuda") == {}
