"""Attention whose output for a query depends only on its sequence's keys, never on the batch.

The engine decodes one query against a KV cache and the trainer runs all positions of packed
sequences at once; both reach `canonical_attention` with the same layout: per sequence, keys
and values at their positions 0..span-1 (zeros past the sequence), queries as [S, kv heads,
query heads per kv head, positions, D] with each query's position. Every query attends over
all `span` key slots with the ones it may not see masked to -inf, so the softmax's max, the
exp and both reductions have the same lengths on both sides, and a masked slot adds an exact 0.

On CPU both GEMMs are exact (`_attend_exact`, verl_async/invariant/exact.py): no call shape,
thread count or BLAS can change a query's bits, and the masked slots past the last query's position
can be left out (the bit widths stay the span's). On CUDA queries go through in tiles of `tile`
positions (decode pads its single query), so each GEMM has the fixed shape
[heads per kv head x tile, D] x [D, span] and [.. x tile, span] x [span, D + 1]: the last
column of `[V | 1]` gives the softmax's denominator from the same GEMM (float32, inputs upcast).
The result is in the query's dtype. With triton (`triton_ops.use_triton`, CUDA) one launch replaces the
tiles (`triton_softmax.attention_forward`: keys in fixed blocks from 0 upwards, an online softmax, a block a
query does not see skipped for it exactly), so neither side pads its keys to the span.

Training needs gradients: `CanonicalAttention` returns this forward and differentiates the same
function through torch's SDPA with the same mask (a gradient need not match bit for bit); the trainer's
layout without a window is SDPA's causal mask, and its flash kernel serves.

`attention_forward` is the transformers attention interface (registered as `ATTENTION_NAME`).
It reads the layout from what the caller passes: a 4-D mask means the native engine's slot
layout (batch row = sequence, key column = position; the engine builds those masks and this
function rebuilds them from `position_ids`); otherwise the trainer's tokens (packed, with
`cu_seq_lens_q` or positions restarting at 0, or padded with a 2-D padding mask) are
scattered into the canonical layout and gathered back.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F

from verl_async.invariant import exact, triton_ops, triton_softmax
from verl_async.invariant.shapes import shapes_for

EXACT_CHUNK_ELEMENTS = 1 << 22  # float64 scores per query chunk of the CPU forward (memory only)
ATTENTION_NAME = "true_on_policy"
SPAN_ATTR = "_true_on_policy_span"  # set on each attention module by model.make_invariant


def _allowed(q_pos: torch.Tensor, span: int, window: Optional[int]) -> torch.Tensor:
    """[..., M, span] bool: key k is visible to a query at position p iff k <= p (and k > p - window)."""
    keys = torch.arange(span, device=q_pos.device)
    ok = keys <= q_pos[..., None]
    if window:
        ok &= keys > q_pos[..., None] - window
    return ok


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
            window: Optional[int], tile: int, span: int) -> torch.Tensor:
    """q [S, G, R, M, D], k/v [S, G, L, D], q_pos [S, M] -> [S, G, R, M, D]: the Triton kernel where
    `use_triton`, CPU exact, else fixed tiles (there L must be the span)."""
    if triton_ops.use_triton(q.device):
        return triton_softmax.attention_forward(q, k, v, q_pos, scale, window)
    if q.device.type == "cpu":
        return _attend_exact(q, k, v, q_pos, scale, window, span)
    M = q.shape[3]
    pad = -M % tile
    if pad:
        q = F.pad(q, (0, 0, 0, pad))
        q_pos = F.pad(q_pos, (0, pad))  # padding queries sit at position 0: one visible key, finite garbage
    out = _attend_tiles(q, k, v, q_pos, scale, window, tile)
    return out[:, :, :, :M] if pad else out


def _attend_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                  window: Optional[int], tile: int) -> torch.Tensor:
    """q [S, G, R, M, D] (M a multiple of tile), k/v [S, G, L, D], q_pos [S, M] -> [S, G, R, M, D]."""
    S, G, R, M, D = q.shape
    L = k.shape[2]
    kt = k.float().reshape(S * G, L, D).transpose(1, 2)
    vx = torch.cat([v.float(), v.new_ones((S, G, L, 1), dtype=torch.float32)], dim=-1).reshape(S * G, L, D + 1)
    out = q.new_empty((S, G, R, M, D))
    for t0 in range(0, M, tile):
        qt = q[:, :, :, t0 : t0 + tile].float().reshape(S * G, R * tile, D)
        scores = torch.bmm(qt, kt).mul_(scale).view(S, G, R, tile, L)
        allowed = _allowed(q_pos[:, t0 : t0 + tile], L, window)[:, None, None]  # [S, 1, 1, tile, L]
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.exp(scores - scores.amax(-1, keepdim=True)).view(S * G, R * tile, L)
        acc = torch.bmm(weights, vx).view(S, G, R, tile, D + 1)
        out[:, :, :, t0 : t0 + tile] = (acc[..., :D] / acc[..., D:]).to(q.dtype)
    return out


def _attend_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                  window: Optional[int], span: int) -> torch.Tensor:
    """The CPU forward: both GEMMs exact (exact.py), so no call shape or BLAS can change a query's bits.

    Scores: each query row on a grid of `53 - 24 - ceil(log2 D)` bits, each key row on a 24-bit grid,
    one exact float64 GEMM. Softmax in float32 (elementwise), its denominator an exact sum. Values: the
    probability of key l times 2^(e_l) (e_l: value row l's exponent, exact), that row on a grid of
    `53 - 24 - ceil(log2 L)` bits in two slices, value rows on 24-bit grids: the numerator's GEMM is
    exact too. Every grid comes from the query's own visible keys or one key's own data, so a decode
    query against the cache and the same query in a training sequence get the same bits. The bit
    widths come from `span`, not from L: any number L <= span of key columns past the visible ones
    (masked: an exact 0 everywhere) gives the same bits, so callers pass only the keys in use. Queries
    go through in chunks only to bound memory (exact results do not depend on them either).
    """
    S, G, R, M, D = q.shape
    L = k.shape[2]
    if L > span:
        raise ValueError(f"true_on_policy attention: {L} keys exceed the span {span}")
    SG = S * G
    k64, v64 = k.detach().to(torch.float64), v.detach().to(torch.float64)
    ek, ev = exact.row_exponents(k64), exact.row_exponents(v64)  # [S, G, L, 1]
    key_ints = exact.grid_slices(k64, ek, exact.WEIGHT_BITS, 1)[0].view(SG, L, D).transpose(1, 2)
    value_ints = exact.grid_slices(v64, ev, exact.WEIGHT_BITS, 1)[0].view(SG, L, D)
    key_scale = exact.pow2(ek - exact.WEIGHT_BITS).view(SG, 1, L)
    value_up = exact.pow2(ev).view(SG, 1, L)
    q_bits = exact.MANTISSA_BITS - exact.WEIGHT_BITS - exact.ceil_log2(D)
    p_bits = exact.MANTISSA_BITS - exact.WEIGHT_BITS - exact.ceil_log2(span)
    out = q.new_empty((S, G, R, M, D))
    chunk = max(1, EXACT_CHUNK_ELEMENTS // max(1, SG * R * L))
    for t0 in range(0, M, chunk):
        c = min(chunk, M - t0)
        q64 = q[:, :, :, t0 : t0 + c].detach().to(torch.float64)
        eq = exact.row_exponents(q64)  # [S, G, R, c, 1]
        q_ints = exact.grid_slices(q64, eq, q_bits, 1)[0].view(SG, R * c, D)
        scores = exact.batched_gemm(q_ints, key_ints) * exact.pow2(eq - q_bits).view(SG, R * c, 1) * key_scale
        scores = (scores * scale).to(torch.float32).view(S, G, R, c, L)
        allowed = _allowed(q_pos[:, t0 : t0 + c], L, window)[:, None, None]  # [S, 1, 1, c, L]
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = torch.exp(scores - scores.amax(-1, keepdim=True)).view(SG, R * c, L).to(torch.float64)
        denominator = exact.sum_last(p, span)  # [SG, Rc, 1]
        weighted = p * value_up  # exact: a power of two per key
        ew = exact.row_exponents(weighted)
        w_ints = exact.grid_slices(weighted, ew, p_bits, 2)  # [2, SG, Rc, L]
        parts = exact.batched_gemm(w_ints.transpose(0, 1).reshape(SG, 2 * R * c, L), value_ints).view(SG, 2, R * c, D)
        numerator = (parts[:, 0] + parts[:, 1] * 2.0 ** -p_bits) * exact.pow2(ew - p_bits - exact.WEIGHT_BITS)
        out[:, :, :, t0 : t0 + c] = (numerator / denominator).view(S, G, R, c, D).to(q.dtype)
    return out


def _reference(q, k, v, q_pos, scale, window, causal=False):
    """The same attention through SDPA (differentiable, any device): the backward's function. `causal`: every
    sequence's queries sit at positions 0..M-1 over keys 0..M-1 without a window (the trainer's layout), so the
    mask is SDPA's own causal one and its flash kernel serves (a masked call takes a slower kernel over every key)."""
    S, G, R, M, D = q.shape
    qh = q.reshape(S, G * R, M, D)
    kh = k.repeat_interleave(R, dim=1) if R > 1 else k
    vh = v.repeat_interleave(R, dim=1) if R > 1 else v
    if causal:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        mask = _allowed(q_pos, k.shape[2], window)[:, None]  # [S, 1, M, L]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.view(S, G, R, M, D)


class CanonicalAttention(torch.autograd.Function):
    """Forward: `_attend` (batch-invariant). Backward: the gradient of the same attention via SDPA."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, scale, window, tile, span, causal):  # type: ignore[override]
        ctx.save_for_backward(q, k, v, q_pos)
        ctx.scale, ctx.window, ctx.causal = scale, window, causal
        return _attend(q, k, v, q_pos, scale, window, tile, span)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, q_pos = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3])]
            out = _reference(*leaves, q_pos, ctx.scale, ctx.window, ctx.causal)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
        return (*(next(grads) if t.requires_grad else None for t in leaves), None, None, None, None, None, None)


def canonical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, *, scale: float,
                        window: Optional[int] = None, span: Optional[int] = None,
                        causal: bool = False) -> torch.Tensor:
    """q [S, G, R, M, D], k/v [S, G, L, D], q_pos [S, M] -> [S, G, R, M, D] (on CUDA M is padded to the tile).

    `span` (default L): the key slots both sides attend over. On CPU L may be shorter (keys past every
    query's position left out, same bits); on CUDA L must be the span. `causal` (the caller's word, not
    checked: a check would wait on the device): q_pos[s] is 0..M-1, L == M and no window, so the backward
    takes SDPA's causal kernel; the forward's bits are the same either way."""
    tile = shapes_for(q.device).attn_tile
    span = int(k.shape[2] if span is None else span)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        causal = bool(causal) and window is None and k.shape[2] == q.shape[3]
        return CanonicalAttention.apply(q, k, v, q_pos, float(scale), window, tile, span, causal)
    return _attend(q, k, v, q_pos, float(scale), window, tile, span)  # the engine: no autograd bookkeeping


# ---------------------------------------------------------------- layouts

def _keys_fill_the_span(device: torch.device) -> bool:
    """Whether keys must fill all `span` slots: only the chunked CUDA path's fixed GEMM shapes need it (CPU's exact
    sums and the Triton kernel read the keys in use; the bits are the same)."""
    return device.type != "cpu" and not triton_ops.use_triton(device)


def _slot_layout(query, key, value, positions, span, scale, window):
    """Native engine: row b is sequence b, key column c is position c (prefill: the new keys; decode: the slot)."""
    B, H, Lq, D = query.shape
    G = key.shape[1]
    Lk = key.shape[2]
    if Lk > span:
        raise ValueError(f"true_on_policy attention: {Lk} keys exceed the span {span}")
    if Lk < span and _keys_fill_the_span(query.device):
        key = F.pad(key, (0, 0, 0, span - Lk))
        value = F.pad(value, (0, 0, 0, span - Lk))
    q = query.reshape(B, G, H // G, Lq, D)
    out = canonical_attention(q, key, value, positions.expand(B, Lq), scale=scale, window=window, span=span)
    return out.reshape(B, H, Lq, D).transpose(1, 2)


def _token_layout(q_tok, k_tok, v_tok, seq, pos, num_seqs, span, scale, window):
    """Trainer: tokens [N, heads, D] with their sequence and position, scattered per sequence and back."""
    N, H, D = q_tok.shape
    G = k_tok.shape[1]
    if N and int(pos.max()) >= span:
        raise ValueError(f"true_on_policy attention: position {int(pos.max())} is past the span {span} "
                         f"(prompt_length + response_length)")
    M = int(pos.max()) + 1 if N else 1
    L = span if _keys_fill_the_span(q_tok.device) else M  # the chunked CUDA path's fixed span, else the keys in use
    q_index = seq * M + pos
    k_index = seq * L + pos
    qc = q_tok.new_zeros((num_seqs * M, H, D)).index_copy(0, q_index, q_tok)
    kc = k_tok.new_zeros((num_seqs * L, G, D)).index_copy(0, k_index, k_tok)
    vc = v_tok.new_zeros((num_seqs * L, G, D)).index_copy(0, k_index, v_tok)
    q = qc.view(num_seqs, M, G, H // G, D).permute(0, 2, 3, 1, 4)
    k = kc.view(num_seqs, L, G, D).transpose(1, 2)
    v = vc.view(num_seqs, L, G, D).transpose(1, 2)
    q_pos = torch.arange(M, device=q_tok.device).expand(num_seqs, M)
    out = canonical_attention(q, k, v, q_pos, scale=scale, window=window, span=span, causal=True)  # [S, G, R, M, D]
    return out.permute(0, 3, 1, 2, 4).reshape(num_seqs * M, H, D).index_select(0, q_index)


def _packed_sequences(positions: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Sequence index of each packed token: from `cu_seq_lens_q`, else a new sequence wherever the position is 0."""
    n = positions.numel()
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=positions.device, dtype=torch.long)
        lengths = cu[1:] - cu[:-1]
        return torch.repeat_interleave(torch.arange(lengths.numel(), device=positions.device), lengths, output_size=n), \
            int(lengths.numel())
    starts = (positions == 0).long()
    return starts.cumsum(0) - 1, int(starts.sum())


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, scaling: Optional[float] = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q [B, H, Lq, D], k/v [B, G, Lk, D] -> ([B, Lq, H, D], None)."""
    span = getattr(module, SPAN_ATTR, None)
    if span is None:
        raise RuntimeError("true_on_policy attention: the model was not prepared by verl_async.invariant.make_invariant")
    positions = kwargs.get("position_ids")
    if positions is None:
        raise ValueError("true_on_policy attention needs position_ids")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        return _slot_layout(query, key, value, positions.to(query.device), span, scale, window), None
    B, H, L, D = query.shape
    q_tok, k_tok, v_tok = (t.transpose(1, 2) for t in (query, key, value))  # [B, L, heads, D]
    positions = positions.to(query.device).expand(B, L)
    if attention_mask is None:  # packed: one row of sequences back to back
        if B != 1:
            raise ValueError(f"true_on_policy attention: unpadded input must be one packed row, got batch {B}")
        seq, num_seqs = _packed_sequences(positions[0], kwargs.get("cu_seq_lens_q"))
        out = _token_layout(q_tok[0], k_tok[0], v_tok[0], seq, positions[0], num_seqs, span, scale, window)
        return out.unsqueeze(0), None
    valid = attention_mask.to(device=query.device, dtype=torch.bool)  # [B, L] padding mask (see padding_mask)
    rows, cols = valid.nonzero(as_tuple=True)
    out_tok = _token_layout(q_tok[rows, cols], k_tok[rows, cols], v_tok[rows, cols], rows, positions[rows, cols],
                            B, span, scale, window)
    out = q_tok.new_zeros((B, L, H, D)).index_put((rows, cols), out_tok)
    return out, None


def padding_mask(*args: Any, attention_mask: Optional[torch.Tensor] = None, **kwargs: Any) -> Optional[torch.Tensor]:
    """transformers' mask interface: hand the 2-D padding mask (or None when packed) to `attention_forward`."""
    return attention_mask


@functools.lru_cache(maxsize=None)
def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, padding_mask)
    return ATTENTION_NAME
