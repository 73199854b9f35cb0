"""verl_async.invariant.triton_softmax (issue 41 item 2): the Triton attention and sampled-token log-prob.

A query's attention output and a row's log-prob have the same bits whatever else shares the launch: the engine's
decode query (one position against its KV cache, garbage past it) and the trainer's query (all positions of the
sequence at once) agree; values are torch's (SDPA, log_softmax) within float rounding. On CUDA natively, on CPU
under Triton's interpreter (tests/triton_interpreter.py), where it checks the kernels' indexing, masking, block
walk and reduction order, not GPU numerics (scripts/bench_invariant_triton.py checks those). Skipped without triton.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.triton_interpreter import DEVICE, fresh_process_only, kernels, rand, run_in_fresh_process
from verl_async.algos.logprob import logprobs_and_entropy, reference_logprobs_and_entropy
from verl_async.invariant import attention, triton_ops, triton_softmax
from verl_async.invariant.triton_softmax import AttentionConfig

triton = pytest.importorskip("triton")
tl = triton.language
from verl_async.invariant._triton_kernels import tree_sum  # noqa: E402 (needs triton)

DTYPES = [torch.float32, torch.bfloat16]
# 16-row query tiles and 16-key blocks: a few positions already span several tiles and blocks (the last partial)
SMALL = AttentionConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
CONFIGS = [pytest.param(SMALL, id="small-blocks"), pytest.param(None, id="default")]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _attend(q, k, v, pos, window=None, config=SMALL):
    return triton_softmax.attention_forward(q, k, v, pos, q.shape[-1] ** -0.5, window, config)


def _sequences(S, G, R, L, D, dtype, seed):
    """q [S, G, R, L, D] at positions 0..L-1 (the trainer's call) and k, v [S, G, L, D]."""
    return (rand(S, G, R, L, D, dtype=dtype, seed=seed), rand(S, G, L, D, dtype=dtype, seed=seed + 1),
            rand(S, G, L, D, dtype=dtype, seed=seed + 2))


# ---------------------------------------------------------------- attention


@kernels
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_sdpa(dtype, config, window):
    S, G, R, L, D = 2, 2, 3, 40, 24  # D = 24: the head block pads to 32; GQA with 3 query heads per KV head
    q, k, v = _sequences(S, G, R, L, D, dtype, seed=0)
    pos = torch.stack([torch.arange(L), torch.arange(L).flip(0)]).to(DEVICE)  # any order of positions
    got = _attend(q, k, v, pos, window, config)
    assert got.dtype == dtype and got.shape == q.shape
    want = attention._reference(q.double(), k.double(), v.double(), pos, D ** -0.5, window)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@kernels
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_query_gets_the_trainers_bits(dtype, config, window):
    """The engine: the query at position p of sequence 1 in a decode batch of 3 (other sequences at other
    positions), its KV cache holding garbage (NaN) past p; and a continuation chunk of 5 positions p..p+4. The
    trainer: every position of the 3 sequences in one call. Equal bits, at positions in the first block, across a
    block boundary and at the end."""
    S, G, R, L, D = 3, 2, 3, 50, 16
    q, k, v = _sequences(S, G, R, L, D, dtype, seed=1)
    trained = _attend(q, k, v, torch.arange(L, device=DEVICE).expand(S, L), window, config)
    others = torch.tensor([7, 0, 31], device=DEVICE)
    for p in (0, 17, 44):
        k_cache, v_cache = k.clone(), v.clone()
        k_cache[1, :, p + 1 :] = float("nan")  # stale slots of the cache: never read
        v_cache[1, :, p + 1 :] = float("nan")
        pos = others.clone()
        pos[1] = p
        q_dec = torch.stack([q[b, :, :, int(pos[b])] for b in range(S)])[:, :, :, None]  # [S, G, R, 1, D]
        decoded = _attend(q_dec, k_cache, v_cache, pos[:, None], window, config)
        assert torch.equal(decoded[1, :, :, 0], trained[1, :, :, p]), p
        k_cache[1, :, p + 5 :] = float("nan")
        v_cache[1, :, p + 5 :] = float("nan")
        k_cache[1, :, p + 1 : p + 5], v_cache[1, :, p + 1 : p + 5] = k[1, :, p + 1 : p + 5], v[1, :, p + 1 : p + 5]
        chunk = _attend(q[1:2, :, :, p : p + 5], k_cache[1:2], v_cache[1:2],
                        torch.arange(p, p + 5, device=DEVICE)[None], window, config)
        assert torch.equal(chunk[0], trained[1, :, :, p : p + 5]), p


@kernels
@settings(max_examples=12, deadline=None)
@given(S=st.integers(1, 3), G=st.integers(1, 2), R=st.integers(1, 3), D=st.sampled_from([8, 16, 20]),
       L=st.integers(1, 40), window=st.one_of(st.none(), st.integers(1, 12)), data=st.data())
def test_a_querys_bits_do_not_depend_on_its_launch(S, G, R, D, L, window, data):
    """Random positions (any order, repeats), then a random slice of the sequences and of the query positions
    alone: the same bits as in the full call."""
    M = data.draw(st.integers(1, 2 * L))
    q = rand(S, G, R, M, D, dtype=torch.float32, seed=S * 100 + M)
    k, v = rand(S, G, L, D, dtype=torch.float32, seed=L), rand(S, G, L, D, dtype=torch.float32, seed=L + 1)
    pos = torch.randint(0, L, (S, M), generator=torch.Generator().manual_seed(M)).to(DEVICE)
    full = _attend(q, k, v, pos, window)
    s0 = data.draw(st.integers(0, S - 1))
    s1 = data.draw(st.integers(s0 + 1, S))
    m0 = data.draw(st.integers(0, M - 1))
    m1 = data.draw(st.integers(m0 + 1, M))
    part = _attend(q[s0:s1, :, :, m0:m1], k[s0:s1], v[s0:s1], pos[s0:s1, m0:m1], window)
    assert torch.equal(part, full[s0:s1, :, :, m0:m1])
    want = attention._reference(q.double(), k.double(), v.double(), pos, D ** -0.5, window)
    torch.testing.assert_close(full.double(), want, **TOL[torch.float32])


@kernels
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_stopping_after_the_last_visible_block_changes_no_bit(dtype, config, window):
    """A tile walks keys only up to its last visible block (causal training: about half of them; decode: the keys
    in use) and, with a window, from its first. Walking every block of the span instead gives the same bits: in a
    block a row sees nothing of, its running max, sum and accumulator are kept by a select. The trainer's call of
    whole sequences, and decode rows whose slots hold other (finite) values past their position."""
    S, G, R, L, D = 2, 2, 3, 70, 16  # 16-key blocks: 5 blocks, the last partial; default 64: 2
    q, k, v = _sequences(S, G, R, L, D, dtype, seed=5)
    scale = D ** -0.5
    pos = torch.arange(L, device=DEVICE).expand(S, L)
    stop = triton_softmax.attention_forward(q, k, v, pos, scale, window, config)
    assert torch.equal(stop, triton_softmax.attention_forward(q, k, v, pos, scale, window, config, walk_all=True))
    at = torch.tensor([[3], [40]], device=DEVICE)
    q_dec = torch.stack([q[0, :, :, 3], q[1, :, :, 40]])[:, :, :, None]
    stop = triton_softmax.attention_forward(q_dec, k, v, at, scale, window, config)
    walk = triton_softmax.attention_forward(q_dec, k, v, at, scale, window, config, walk_all=True)
    assert torch.equal(stop, walk)
    assert torch.equal(stop[0, :, :, 0], triton_softmax.attention_forward(q, k, v, pos, scale, window, config)[0, :, :, 3])


def test_the_attention_tile_follows_the_head_dim_or_the_environment(monkeypatch):
    monkeypatch.delenv(triton_softmax.ATTN_TILE_ENV, raising=False)
    assert triton_softmax.attention_config(64) == AttentionConfig()
    assert triton_softmax.attention_config(128) == AttentionConfig(num_warps=8)
    monkeypatch.setenv(triton_softmax.ATTN_TILE_ENV, "128,64,8,3")
    assert triton_softmax.attention_config(64) == AttentionConfig(128, 64, 8, 3)
    monkeypatch.setenv(triton_softmax.ATTN_TILE_ENV, "128,64,8")
    with pytest.raises(ValueError, match="VERL_ASYNC_INVARIANT_ATTN_TILE='128,64,8': want BLOCK_M,BLOCK_N"):
        triton_softmax.attention_config(64)


@kernels
def test_a_different_key_order_changes_bits():
    """The equality checks above can fail: the same keys walked from the other end (the same sums in another
    order) give other bits for some query."""
    S, G, R, L, D = 1, 1, 2, 48, 16
    q, k, v = _sequences(S, G, R, L, D, torch.float32, seed=2)
    last = torch.full((1, L), L - 1, device=DEVICE)
    a = _attend(q, k, v, last)
    b = _attend(q, k.flip(2).contiguous(), v.flip(2).contiguous(), last)
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, b)


@kernels
def test_the_engine_and_trainer_layouts_agree_through_the_wiring(monkeypatch):
    """`attention_forward`'s two layouts with `use_triton` on (CUDA's switch; the interpreter stands in on CPU):
    the engine's slot layout (a decode query against its cache slot, no padding to the span) and the trainer's
    packed tokens (two sequences back to back) give a token the same bits, and the Triton path is the one taken.
    Gradients come from SDPA (CanonicalAttention's backward)."""
    monkeypatch.setattr(triton_ops, "use_triton", lambda device: True)
    H, G, D, span = 4, 2, 16, 64
    lengths = (9, 20)
    n = sum(lengths)
    q_tok, k_tok, v_tok = (rand(n, h, D, dtype=torch.float32, seed=h + i) for i, h in enumerate((H, G, G)))
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths)).to(DEVICE)
    pos = torch.cat([torch.arange(x) for x in lengths]).to(DEVICE)
    packed = attention._token_layout(q_tok, k_tok, v_tok, seq, pos, 2, span, D ** -0.5, None)
    for token in (0, 8, 9, 20, n - 1):
        s, p = int(seq[token]), int(pos[token])
        first = token - p
        cache_k = torch.full((1, G, span - 3, D), float("nan"), device=DEVICE)  # a cache shorter than the span
        cache_v = cache_k.clone()
        cache_k[0, :, : p + 1] = k_tok[first : token + 1].transpose(0, 1)
        cache_v[0, :, : p + 1] = v_tok[first : token + 1].transpose(0, 1)
        query = q_tok[token][None, :, None]  # [1, H, 1, D]
        decoded = attention._slot_layout(query, cache_k, cache_v, pos[token].view(1, 1), span, D ** -0.5, None)
        assert torch.equal(decoded[0, 0], packed[token]), (s, p)
    # the Triton kernel's own bits, not the exact CPU path's
    q5 = q_tok.view(1, n, G, H // G, D).permute(0, 2, 3, 1, 4)[:, :, :, : lengths[0]]
    k5 = k_tok[: lengths[0]].transpose(0, 1)[None]
    v5 = v_tok[: lengths[0]].transpose(0, 1)[None]
    direct = triton_softmax.attention_forward(q5, k5, v5, torch.arange(lengths[0], device=DEVICE)[None], D ** -0.5)
    assert torch.equal(direct.permute(0, 3, 1, 2, 4).reshape(lengths[0], H, D), packed[: lengths[0]])
    leaves = [t.clone().requires_grad_() for t in (q5, k5, v5)]
    out = attention.canonical_attention(*leaves, torch.arange(lengths[0], device=DEVICE)[None], scale=D ** -0.5,
                                        span=span)
    assert torch.equal(out.detach(), direct)
    g = rand(*out.shape, dtype=torch.float32, seed=9)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q5, k5, v5)]
    ref = attention._reference(*ref_leaves, torch.arange(lengths[0], device=DEVICE)[None], D ** -0.5, None)
    for a, b in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, ref_leaves, g)):
        torch.testing.assert_close(a, b)


@kernels
def test_bad_attention_inputs_are_named():
    q, k, v = _sequences(1, 2, 2, 8, 16, torch.float32, seed=3)
    pos = torch.arange(8, device=DEVICE)[None]
    with pytest.raises(ValueError, match=r"k \(1, 2, 8, 8\) does not fit q"):
        triton_softmax.attention_forward(q, k[..., :8], v[..., :8], pos, 0.25)
    with pytest.raises(ValueError, match=r"q_pos must be integer \[S, M\] = \[1, 8\]"):
        triton_softmax.attention_forward(q, k, v, pos.float(), 0.25)
    with pytest.raises(TypeError, match="k torch.bfloat16"):
        triton_softmax.attention_forward(q, k.bfloat16(), v, pos, 0.25)


# ---------------------------------------------------------------- log-prob


def _logits(n, vocab, dtype, seed, spread=4.0):
    x = rand(n, vocab, dtype=torch.float32, seed=seed) * spread
    x[min(1, n - 1), 10:200] = float("-inf")  # a masked stretch (0 * -inf must count as 0 in the entropy)
    return x.to(dtype)


def _labels(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@kernels
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("block", [64, None], ids=["block-64", "default"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_logprob_matches_log_softmax(dtype, block, temperature):
    x, labels = _logits(6, 300, dtype, seed=0), _labels(6, 300, seed=1)  # 300 = 4 blocks of 64 and a partial one
    labels[1] = 3  # not masked
    logp, ent = triton_softmax.token_logprobs(x, labels, temperature, with_entropy=True, block=block)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == (6,)
    want_logp, want_ent = logprobs_and_entropy(x, labels, temperature)
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    finite = torch.arange(6, device=DEVICE) != 1  # (the naive reference's entropy is NaN on -inf logits)
    ref_logp, ref_ent = reference_logprobs_and_entropy(x.double(), labels, temperature)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double()[finite], ref_ent[finite], atol=1e-5, rtol=1e-5)


@kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_logprob_bits_do_not_depend_on_the_batch(dtype):
    """Each of 8 rows alone, and rows among 9 at the first, a middle and the last position, against one call of 40;
    with and without the entropy, and from float32 logits (the engine upcasts them; the trainer's are the model's
    dtype): equal bits. Flat logits (spread 0.5), so that the sums' order shows in the last bits: another block
    size (another order) changes some row."""
    vocab, block = 300, 64
    x, labels = _logits(40, vocab, dtype, seed=2, spread=0.5), _labels(40, vocab, seed=3)
    full_logp, full_ent = triton_softmax.token_logprobs(x, labels, 0.9, with_entropy=True, block=block)
    assert torch.equal(triton_softmax.token_logprobs(x, labels, 0.9, block=block), full_logp)
    assert torch.equal(triton_softmax.token_logprobs(x.float(), labels, 0.9, block=block), full_logp)
    for r in range(8):
        logp, ent = triton_softmax.token_logprobs(x[r : r + 1], labels[r : r + 1], 0.9, with_entropy=True, block=block)
        assert torch.equal(logp[0], full_logp[r]) and torch.equal(ent[0], full_ent[r]), r
    for r, at in ((9, 0), (23, 4), (39, 8)):
        batch, batch_labels = _logits(9, vocab, dtype, seed=100 + r, spread=0.5), _labels(9, vocab, seed=r)
        batch[at], batch_labels[at] = x[r], labels[r]
        logp, ent = triton_softmax.token_logprobs(batch, batch_labels, 0.9, with_entropy=True, block=block)
        assert torch.equal(logp[at], full_logp[r]) and torch.equal(ent[at], full_ent[r]), (r, at)
    other = triton_softmax.token_logprobs(x[:8], labels[:8], 0.9, with_entropy=True, block=2 * block)
    torch.testing.assert_close(other, (full_logp[:8], full_ent[:8]))
    assert not (torch.equal(other[0], full_logp[:8]) and torch.equal(other[1], full_ent[:8]))
    # leading dims, a strided view (rows of a bigger tensor)
    assert torch.equal(triton_softmax.token_logprobs(x.view(4, 10, vocab), labels.view(4, 10), 0.9, block=block),
                       full_logp.view(4, 10))
    assert torch.equal(triton_softmax.token_logprobs(x[::3], labels[::3], 0.9, block=block), full_logp[::3])


@kernels
@pytest.mark.parametrize("with_entropy", [False, True])
def test_logprob_gradients_are_the_plain_formulas(with_entropy):
    x, labels = _logits(5, 300, torch.float32, seed=4), _labels(5, 300, seed=5)
    labels[1] = 3
    g_logp, g_ent = rand(5, dtype=torch.float32, seed=6), rand(5, dtype=torch.float32, seed=7)
    # The reference runs in float64: the entropy's gradient sums 300 float32 terms, whose order differs between the
    # kernel and torch (an H200 gave 1.9e-5 apart on an entry of ~2), so both are held to float64's answer.
    ours, ref = x.clone().requires_grad_(), x.double().requires_grad_()
    got = triton_softmax.token_logprobs(ours, labels, 0.7, with_entropy=with_entropy, block=64)
    want = logprobs_and_entropy(ref, labels, 0.7)
    if with_entropy:
        (got[0] * g_logp + got[1] * g_ent).sum().backward()
        (want[0] * g_logp.double() + want[1] * g_ent.double()).sum().backward()
    else:
        (got * g_logp).sum().backward()
        (want[0] * g_logp.double()).sum().backward()
    assert ours.grad.dtype == torch.float32
    torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-5, atol=5e-5)


@kernels
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_logprob_backward_kernel_is_eager_backwards_formula(dtype, temperature):
    """One pass per row (`logprob_backward_kernel`) against `algos.logprob.eager_backward`, with the log-prob's
    gradient, the entropy's or both, a -inf logit, and more than one vocab block."""
    from verl_async.algos.logprob import eager_backward

    x, labels = _logits(6, 300, dtype, seed=8), _labels(6, 300, seed=9)
    x[2, 7] = float("-inf")
    lse, logp, ent = triton_softmax._logprob_launch(x, labels, temperature, True, True, 64)
    g_logp, g_ent = rand(6, dtype=torch.float32, seed=10), rand(6, dtype=torch.float32, seed=11)
    for gl, ge in ((g_logp, None), (None, g_ent), (g_logp, g_ent)):
        got = triton_softmax._logprob_backward(x, labels, lse, ent, gl, ge, temperature)
        want = eager_backward(x, labels, lse, ent, gl, ge, temperature)
        assert got.dtype == dtype and bool(torch.isfinite(got).all())
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@kernels
def test_the_logprob_wiring(monkeypatch):
    """invariant.logprob's three entry points take the kernel where `use_triton` holds (float64 logits keep the
    chunked path); the engine's sampled_logprobs with mixed temperatures is the kernel per row."""
    from verl_async.invariant import logprob

    monkeypatch.setattr(triton_ops, "use_triton", lambda device: True)
    x, labels = _logits(6, 300, torch.bfloat16, seed=8), _labels(6, 300, seed=9)
    want, want_ent = triton_softmax.token_logprobs(x, labels, 0.8, with_entropy=True)
    assert torch.equal(logprob.token_logprobs(x, labels, 0.8), want)
    got, got_ent = logprob.token_logprobs_and_entropy(x, labels, 0.8)
    assert torch.equal(got, want) and torch.equal(got_ent, want_ent)
    mixed = logprob.sampled_logprobs(x.float(), labels, [0.8, 0.0, 0.8, 1.0, 0.8, 0.0])
    at_one = triton_softmax.token_logprobs(x, labels, 1.0)
    assert torch.equal(mixed, torch.where(torch.tensor([1, 0, 1, 0, 1, 0], device=DEVICE).bool(), want, at_one))
    x64 = x.double()
    assert logprob.token_logprobs(x64, labels, 0.8).dtype == torch.float64


@kernels
def test_bad_logprob_inputs_are_named():
    x = _logits(3, 300, torch.float32, seed=10)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 300\)"):
        triton_softmax.token_logprobs(x, torch.tensor([0, 300, 1], device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="labels has shape"):
        triton_softmax.token_logprobs(x, torch.zeros(2, dtype=torch.long, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="block 48 is not a power of two"):
        triton_softmax.token_logprobs(x, torch.zeros(3, dtype=torch.long, device=DEVICE), 1.0, block=48)
    with pytest.raises(TypeError, match="torch.float64"):
        triton_softmax.token_logprobs(x.double(), torch.zeros(3, dtype=torch.long, device=DEVICE), 1.0)


# ---------------------------------------------------------------- the lane reduction


@triton.jit
def _tree_sum_kernel(x_ptr, o_ptr, N: tl.constexpr, LOG_N: tl.constexpr):
    tl.store(o_ptr, tree_sum(tl.load(x_ptr + tl.arange(0, N)), N, LOG_N))


@kernels
def test_tree_sum_is_the_pairwise_tree_over_logical_indices():
    """The RMSNorm's and the log-prob's lane reduction: x[i] + x[i + N/2], halving; an order no register layout
    can change. Its bits are those of the same tree in torch, and not those of a left-to-right sum."""
    x = rand(256, dtype=torch.float32, seed=11) * torch.logspace(-6, 6, 256, device=DEVICE)
    out = torch.empty(1, device=DEVICE)
    _tree_sum_kernel[(1,)](x, out, N=256, LOG_N=8)
    y = x.clone()
    while y.numel() > 1:
        y = y[: y.numel() // 2] + y[y.numel() // 2 :]
    assert torch.equal(out, y)
    sequential = torch.zeros((), device=DEVICE)
    for value in x:
        sequential = sequential + value
    assert not torch.equal(out[0], sequential)


@fresh_process_only
def test_in_a_fresh_process():
    run_in_fresh_process(__file__)


# ---------------------------------------------------------------- the mode end to end


@pytest.mark.slow  # ~45 s on CPU under the interpreter
@kernels
def test_the_engine_and_trainer_agree_through_the_triton_path(monkeypatch, tmp_path):
    """True on-policy mode with every kernel on the Triton path (`use_triton` forced; on CPU the interpreter stands
    in for CUDA): the tiny Llama's engine log-probs (right-padded prefill, decode batches of 3, rows leaving and
    joining) equal the FSDP2 trainer's recompute bitwise, packed and padded, in one micro-batch or one row each, and
    the training forward's PPO ratio of the first mini-batch is exactly 1."""
    for module in ("ray", "hydra", "omegaconf", "tensordict"):  # the trainer's (a bare GPU image may lack them)
        pytest.importorskip(module)
    from onpolicy_helpers import PROMPTS, batch_of, generate, log_probs, rank, train_step

    from verl_async.models.tiny import build_tiny_model_dir

    calls = {"attention": 0, "logprob": 0}
    attend, logprobs = triton_softmax.attention_forward, triton_softmax.token_logprobs

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(triton_ops, "use_triton", lambda device: True)
    monkeypatch.setattr(triton_softmax, "attention_forward", counted("attention", attend))
    monkeypatch.setattr(triton_softmax, "token_logprobs", counted("logprob", logprobs))
    model_dir = build_tiny_model_dir(str(tmp_path), family="llama")
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    batch = batch_of(PROMPTS, generate(model_dir, dtype=dtype, true_on_policy=True, device=DEVICE))
    rollout, valid = batch["rollout_log_probs"], batch["response_mask"].bool()
    assert calls["attention"] > 0 and calls["logprob"] > 0
    worker = rank(model_dir, true_on_policy=True, bf16=dtype == torch.bfloat16, device=DEVICE)
    try:
        for packed in (True, False):
            worker.set_options({"use_remove_padding": packed})
            for split in ([[0, 1, 2, 3, 4]], [[0], [1], [2], [3], [4]]):
                ours = log_probs(worker, batch, split)
                assert torch.equal(ours[valid], rollout[valid]), (packed, split, (ours - rollout)[valid].abs().max())
        worker.set_options({"use_remove_padding": True})
        metrics = train_step(worker, batch, rollout)
        assert metrics["actor/first_minibatch_ratio_dev_max"] == 0.0
    finally:
        worker.shutdown()
