"""Ulysses sequence parallelism for the FSDP2 trainer (`actor_rollout_ref.actor.ulysses_sequence_parallel_size`).

`sp` consecutive ranks form a sequence-parallel group; the group shares one data-parallel
share of the plan (its `dp_rank` is `rank // sp`). A packed micro-batch (one row, the
sequences back to back, `cu_seqlens`) is padded to a multiple of `sp` and cut into `sp`
equal slices; rank `i` of the group runs the model on slice `i` only, so activations and
logits per rank shrink by `sp`. Everything but attention is per token. Attention needs
whole sequences: around it an all-to-all trades the sequence split for a head split
([n/sp tokens, H heads] -> [n tokens, H/sp heads]), the inner kernel (`varlen`, or
flash-attention's varlen path) runs causal attention per sequence over the full packed row
with the group's `cu_seqlens`, and a second all-to-all trades back (DeepSpeed-Ulysses,
verl's `ulysses_flash_attn_forward`). KV heads fewer than `sp` are repeated first (GQA).

The log-probs (and entropy) of every position are gathered over the group, so each rank
holds the micro-batch's full values and computes the same loss; the gather's backward
hands each rank the gradient of its own slice only, which makes the group's gradients sum
to the full one (FSDP averages over all dp * sp ranks: the worker multiplies the loss by
the world size as without SP). Labels are the next token of the full packed row, taken
before it is cut.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

ULYSSES = "ulysses"
_ACTIVE: Optional["SPGroup"] = None  # the group of the forward in progress (None: attention runs unsplit)
_INNER: dict[str, str] = {"name": "varlen"}  # the kernel inside: varlen | flash_attention_2


@dataclass(frozen=True)
class SPGroup:
    group: Any  # the torch.distributed process group of the sp ranks
    size: int
    rank: int  # rank within the group


def build_sp_group(world_size: int, rank: int, sp: int) -> Optional[SPGroup]:
    """Groups of `sp` consecutive ranks (every rank must call this: new_group is collective); None for sp == 1."""
    if sp == 1:
        return None
    if world_size % sp:
        raise ValueError(f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} does not divide the trainer's "
                         f"{world_size} ranks")
    mine = None
    for start in range(0, world_size, sp):
        ranks = list(range(start, start + sp))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = SPGroup(group, sp, rank - start)
    return mine


@contextlib.contextmanager
def sequence_parallel(group: Optional[SPGroup]) -> Iterator[None]:
    """Attention of forwards inside is split over `group` (None: not split)."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, group
    try:
        yield
    finally:
        _ACTIVE = previous


# --------------------------------------------------------------------------- collectives with autograd
class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (equal splits); its gradient is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # the collective reads and writes flat memory (empty_like would copy odd strides)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _GatherSeq(torch.autograd.Function):
    """All-gather of equal slices along `dim`; backward keeps this rank's slice (every rank's loss is the same)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SPGroup, dim: int) -> torch.Tensor:
        ctx.sp, ctx.dim, ctx.length = sp, dim, x.shape[dim]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x, group=sp.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.sp.rank * ctx.length
        return grad.narrow(ctx.dim, start, ctx.length).contiguous(), None, None


def gather_sequence(x: torch.Tensor, sp: SPGroup, dim: int = 1) -> torch.Tensor:
    return _GatherSeq.apply(x, sp, dim)


def seq_to_heads(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """[1, H, n, D] (this rank's tokens, all heads) -> [1, H/sp, n*sp, D] (all tokens, this rank's heads)."""
    _, heads, n, d = x.shape
    x = x.reshape(sp.size, heads // sp.size, n, d)  # chunk j of the heads goes to rank j
    x = _AllToAll.apply(x, sp.group)  # now chunk j holds rank j's tokens of our heads
    return x.permute(1, 0, 2, 3).reshape(1, heads // sp.size, sp.size * n, d)


def heads_to_seq(x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
    """[1, N, H/sp, D] (all tokens, this rank's heads) -> [1, N/sp, H, D] (this rank's tokens, all heads)."""
    _, length, heads, d = x.shape
    n = length // sp.size
    x = x.reshape(sp.size, n, heads, d)  # token chunk j goes to rank j
    x = _AllToAll.apply(x, sp.group)  # now chunk j holds our tokens of rank j's heads
    return x.permute(1, 0, 2, 3).reshape(1, n, sp.size * heads, d)


def _repeat_kv(x: torch.Tensor, sp: int) -> torch.Tensor:
    """KV heads repeated so that `sp` divides them (each query head keeps its KV head)."""
    heads = x.shape[1]
    if heads % sp == 0:
        return x
    return x.repeat_interleave(sp // math.gcd(heads, sp), dim=1)


def ulysses_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: all-to-all, the inner kernel over whole sequences, all-to-all back."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS[_INNER["name"]]
    sp = _ACTIVE
    if sp is None:
        return inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("Ulysses sequence parallelism runs packed rows only (actor_rollout_ref.model."
                         "use_remove_padding=true)")
    if query.shape[1] % sp.size:
        raise ValueError(f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp.size} does not divide the "
                         f"model's {query.shape[1]} attention heads")
    q = seq_to_heads(query, sp)
    k = seq_to_heads(_repeat_kv(key, sp.size), sp)
    v = seq_to_heads(_repeat_kv(value, sp.size), sp)
    out, _ = inner(module, q, k, v, None, scaling=scaling, dropout=dropout, **kwargs)
    return heads_to_seq(out, sp), None


def _no_mask(*args, attention_mask=None, **kwargs):
    """Packed rows need no dense mask (the kernel takes cu_seqlens); unsplit padded rows get sdpa's."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_ulysses_attention(inner: str) -> str:
    """Register `ulysses` around the `inner` kernel (varlen | flash_attention_2); returns the name to load with."""
    if inner not in ("varlen", "flash_attention_2"):
        raise ValueError(f"actor_rollout_ref.model.attn_implementation={inner} can not run under Ulysses sequence "
                         "parallelism (it needs a varlen kernel over packed rows); use auto, varlen or "
                         "flash_attention_2")
    _INNER["name"] = inner
    _register()
    return ULYSSES


@functools.lru_cache(maxsize=None)
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ULYSSES, ulysses_attention_forward)
    AttentionMaskInterface.register(ULYSSES, _no_mask)


# --------------------------------------------------------------------------- the packed row, cut
@dataclass
class SPSlice:
    """This rank's slice of a padded packed row and the full row's labels and kernel kwargs."""

    input_ids: torch.Tensor  # [1, N/sp]
    position_ids: torch.Tensor  # [1, N/sp]
    labels: torch.Tensor  # [1, N/sp]: the next token of each of this rank's positions
    varlen_kwargs: dict  # cu_seq_lens_* / max_length_* of the whole padded row
    length: int  # N (padded) = sp * slice length


def slice_packed(input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                 sp: SPGroup, pad_token_id: int) -> SPSlice:
    """Pad the packed row ([1, n]) to a multiple of sp (the padding is a sequence of its own) and cut this rank's slice."""
    n = input_ids.shape[1]
    pad = (-n) % sp.size
    if pad:
        input_ids = torch.cat([input_ids, input_ids.new_full((1, pad), pad_token_id)], dim=1)
        position_ids = torch.cat([position_ids, torch.arange(pad, dtype=position_ids.dtype).unsqueeze(0)], dim=1)
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([n + pad])])
        max_len = max(max_len, pad)
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    size = (n + pad) // sp.size
    cut = slice(sp.rank * size, (sp.rank + 1) * size)
    kwargs = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": int(max_len),
              "max_length_k": int(max_len)}
    return SPSlice(input_ids[:, cut], position_ids[:, cut], labels[:, cut], kwargs, n + pad)
