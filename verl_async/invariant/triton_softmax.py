"""Batch-invariant attention and sampled-token log-prob as single Triton launches (issue 41 item 2).

The chunked CUDA path (`attention._attend_tiles`, `logprob` with `fixed_chunks`) gets invariance from fixed call
shapes: attention in tiles of 32 query positions, two GEMMs and a Python loop per tile, every query over the
whole span; the log-prob in 64-row chunks. Here one launch covers a call, and a row's bits come from the kernel's
fixed reduction order (`_triton_kernels.attention_kernel`, `logprob_kernel`):

- attention: one program per (sequence, KV head, tile of query rows). Keys go by in blocks of a size that depends
  on the head dim only, from key 0 upwards, with an online softmax in float32; a block in which a query sees no
  key is skipped for that query by a select, so its result is that of walking the whole span, and a tile stops at
  its last visible block (causal training pays half, decode reads only the keys in use). The engine's decode
  query against its KV cache and the trainer's query among all positions of its sequence get the same bits.
  Keys past L (the tensor's key slots) are treated as masked, so L may be anything past the last position.
- log-prob: one program per row, the vocab walked in blocks of a size that depends on the vocab only, a running
  maximum and per-lane sums added once at the end; log-prob, log-sum-exp and optionally entropy in one pass.

Backward passes are the plain formulas (a gradient need not match anything bit for bit): attention's through
SDPA (`attention.CanonicalAttention`), the log-prob's formula (`algos.logprob.eager_backward`'s) in one Triton pass per row
(`logprob_backward_kernel`). Taken on CUDA when
`triton_ops.use_triton` holds (VERL_ASYNC_INVARIANT_TRITON=0 keeps the chunked path); on CPU only under Triton's
interpreter (tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from verl_async.algos.logprob import flatten_checked, normalize_temperature
from verl_async.invariant import triton_ops

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class AttentionConfig:
    """Launch constants of the attention kernel. With the head dim they fix every query's summation order, so
    they must never depend on the number of queries, sequences or keys."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


ATTN_TILE_ENV = "VERL_ASYNC_INVARIANT_ATTN_TILE"  # BLOCK_M,BLOCK_N,num_warps,num_stages for every head dim


def attention_config(head_dim: int) -> AttentionConfig:
    """The config for heads of `head_dim`: past 64, 8 warps, and past 128 a shorter key block (compiled for sm_90
    with Triton 3.6, 4 warps spill registers at D = 80 and 128; these do not). VERL_ASYNC_INVARIANT_ATTN_TILE
    overrides it (experiments: scripts/bench_invariant_triton_softmax.py --attn-sweep times the candidates); it
    changes the bits of engine and trainer alike, so both must run with the same value."""
    tile = triton_ops.parse_tile(ATTN_TILE_ENV, os.environ.get(ATTN_TILE_ENV, ""))
    if tile is not None:
        return AttentionConfig(*tile)
    if head_dim > 128:
        return AttentionConfig(block_n=32, num_warps=8)
    return AttentionConfig(num_warps=8) if head_dim > 64 else AttentionConfig()


def _head_block(head_dim: int) -> int:
    return max(16, 1 << max(head_dim - 1, 1).bit_length())  # tl.dot needs >= 16


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_attention(q, k, v, q_pos) -> None:
    if q.dim() != 5 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"triton attention: want q [S, G, R, M, D] and k, v [S, G, L, D], got q {tuple(q.shape)} "
                         f"k {tuple(k.shape)} v {tuple(v.shape)}")
    S, G, _, M, D = q.shape
    if k.shape[0] != S or k.shape[1] != G or k.shape[3] != D:
        raise ValueError(f"triton attention: k {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    if tuple(q_pos.shape) != (S, M) or q_pos.dtype.is_floating_point:
        raise ValueError(f"triton attention: q_pos must be integer [S, M] = [{S}, {M}], got {q_pos.dtype} "
                         f"{tuple(q_pos.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"triton attention: q {q.dtype}, k {k.dtype}, v {v.dtype}: one of {_DTYPES} expected")
    for label, t in (("k", k), ("v", v), ("q_pos", q_pos)):
        if t.device != q.device:
            raise ValueError(f"triton attention: {label} is on {t.device}, q on {q.device}")
    problem = triton_ops.triton_problem(q.device)
    if problem is not None:
        raise RuntimeError(f"triton attention: {problem}")


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                      window: Optional[int] = None, config: Optional[AttentionConfig] = None,
                      walk_all: bool = False) -> torch.Tensor:
    """q [S, G, R, M, D], k/v [S, G, L, D], q_pos [S, M] -> [S, G, R, M, D] in q's dtype: query (s, g, r, m) at
    position q_pos[s, m] attends to keys k <= position (and > position - window) of sequence s, head g, over
    `attention._allowed`'s mask, its bits independent of every other query and sequence in the call.
    `config`: only for experiments (the default is `attention_config` of D). `walk_all` (tests): every tile walks
    all L keys instead of stopping after its last visible block (the same bits: a block a row does not see leaves
    its state untouched)."""
    _check_attention(q, k, v, q_pos)
    S, G, R, M, D = q.shape
    L = k.shape[2]
    cfg = config or attention_config(D)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    out = torch.empty((S, G, R, M, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if L == 0:
        return out.zero_()
    n_tiles = -(-(R * M) // cfg.block_m)
    interpreted = q.device.type == "cpu"  # (CPU runs only under the interpreter: triton_problem)
    triton_ops._kernels().attention_kernel[(S * G * n_tiles,)](
        q, k, v, q_pos, out, M, L, R, G, n_tiles, float(scale), int(window or 0),
        *q.stride()[:4], *k.stride()[:3], *v.stride()[:3], *q_pos.stride(), *out.stride()[:4],
        D=D, BLOCK_D=_head_block(D), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_WINDOW=bool(window),
        WALK_ALL=bool(walk_all),
        IEEE=q.dtype == torch.float32 or interpreted, UPCAST=interpreted and q.dtype != torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def vocab_block(vocab: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the log-prob kernel for a vocab of `vocab` entries: a function of the vocab only."""
    return triton_ops.norm_block(vocab)


def _logprob_launch(flat: torch.Tensor, labels: torch.Tensor, temperature: float, with_logp: bool,
                    with_entropy: bool, block: Optional[int]):
    n, vocab = flat.shape
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    lse = torch.empty(n, dtype=torch.float32, device=flat.device)
    logp = torch.empty(n, dtype=torch.float32, device=flat.device) if with_logp else None
    ent = torch.empty(n, dtype=torch.float32, device=flat.device) if with_entropy else None
    if n == 0:
        return lse, logp, ent
    if vocab == 0:
        raise ValueError("triton log-prob: the logits have an empty vocab dimension")
    default_block, warps = vocab_block(vocab)
    block = block or default_block
    if block & (block - 1):
        raise ValueError(f"triton log-prob: block {block} is not a power of two")
    triton_ops._kernels().logprob_kernel[(n,)](
        flat, labels if with_logp else lse, lse, logp if with_logp else lse, ent if with_entropy else lse,
        n, vocab, flat.stride(0), 1.0 / temperature, WITH_LOGP=with_logp, WITH_ENT=with_entropy,
        SCALE=temperature != 1.0, BLOCK=block, LOG_BLOCK=block.bit_length() - 1, num_warps=warps,
        enable_fp_fusion=False)  # no a*b+c contracted into an FMA: the with- and without-entropy kernels (and the
    # bf16 and float32 ones) would otherwise be free to contract the log-prob's own arithmetic differently
    return lse, logp, ent


def _logprob_backward(flat, labels, lse, ent, g_logp, g_ent, temperature):
    """The logits' gradient [N, V] in flat's dtype: one Triton pass per row (`logprob_backward_kernel`) instead of
    `algos.logprob.eager_backward`'s ~10 passes over float32 chunk copies (the same formula)."""
    n, vocab = flat.shape
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    grad = torch.empty((n, vocab), dtype=flat.dtype, device=flat.device)
    if n == 0:
        return grad
    block, warps = vocab_block(vocab)
    triton_ops._kernels().logprob_backward_kernel[(n,)](
        flat, labels, lse, ent if ent is not None else lse, g_logp if g_logp is not None else lse,
        g_ent if g_ent is not None else lse, grad, n, vocab, flat.stride(0), grad.stride(0), 1.0 / temperature,
        HAS_LOGP=g_logp is not None, HAS_ENT=g_ent is not None, SCALE=temperature != 1.0, BLOCK=block,
        num_warps=warps)
    return grad


class _TokenLogProb(torch.autograd.Function):
    """Forward: the invariant kernel; backward: one Triton pass per row (`_logprob_backward`)."""

    @staticmethod
    def forward(ctx, flat, labels, temperature, with_entropy, block):  # type: ignore[override]
        lse, logp, ent = _logprob_launch(flat, labels, temperature, True, with_entropy, block)
        ctx.save_for_backward(flat, labels, lse, ent)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):  # type: ignore[override]
        flat, labels, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None
        g_logp = None if g_logp is None else g_logp.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        grad = _logprob_backward(flat, labels, lse, ent, g_logp, g_ent, ctx.temperature)
        return grad, None, None, None, None


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: Optional[float],
                   with_entropy: bool = False, block: Optional[int] = None):
    """[..., V] logits, [...] labels -> [...] float32 `log_softmax(logits / T)[label]` (and the entropy of the
    same distribution when `with_entropy`: a tuple), each row's bits independent of the other rows; temperature
    0 or None means 1 (as `algos.logprob`). Differentiable. `block`: only for tests (default `vocab_block`)."""
    if logits.dtype not in _DTYPES:
        raise TypeError(f"triton log-prob: logits dtype {logits.dtype} is not one of {_DTYPES}")
    problem = triton_ops.triton_problem(logits.device)
    if problem is not None:
        raise RuntimeError(f"triton log-prob: {problem}")
    flat, flat_labels, lead = flatten_checked(logits, labels, True)
    t = normalize_temperature(temperature)
    if torch.is_grad_enabled() and logits.requires_grad:
        logp, ent = _TokenLogProb.apply(flat, flat_labels.contiguous(), t, with_entropy, block)
    else:
        _, logp, ent = _logprob_launch(flat.detach(), flat_labels.contiguous(), t, True, with_entropy, block)
    return (logp.view(lead), ent.view(lead)) if with_entropy else logp.view(lead)
