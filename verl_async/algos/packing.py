"""Sequence packing: variable-length sequences -> flat packs with `cu_seqlens`.

A pack is one micro-batch for a varlen (flash-attention style) forward: the
sequences of the pack are concatenated along the token dimension, `cu_seqlens`
(int32, `[m+1]`, starting at 0) marks their boundaries and `position_ids` restart at
0 for every sequence. Packs are chosen by `partition_by_token_cap` (fewest packs
under a token cap, balanced) or `karmarkar_karp` (a fixed number of packs).
`unpack_sequences` maps per-token outputs of the packs back to per-sequence tensors
in the original order, exactly.

Causal-LM note: in a pack, the logits at flat position t predict token t+1 of the
same sequence only when t is not the last token of its sequence; the last token's
prediction (which would read the next sequence's first token) is meaningless and
must never be used. Shift per sequence (e.g. read positions `cu[i] .. cu[i+1]-2`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from .balancing import karmarkar_karp, partition_by_token_cap


@dataclass
class Pack:
    """One packed micro-batch. `data[key]` is the concatenation of the sequences'
    tensors for that key along dim 0 (`[num_tokens, ...]`)."""

    indices: list[int]  # original sequence indices, in pack order
    cu_seqlens: torch.Tensor  # int32 [len(indices) + 1]
    position_ids: torch.Tensor  # long [num_tokens], restarting at 0 per sequence
    max_seqlen: int
    data: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def seqlens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.data[key]


def _as_dict(sequences: Mapping[str, Sequence[torch.Tensor]] | Sequence[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    if isinstance(sequences, Mapping):
        data = {str(k): list(v) for k, v in sequences.items()}
    else:
        data = {"input_ids": list(sequences)}
    if not data:
        raise ValueError("sequences: give at least one key")
    counts = {k: len(v) for k, v in data.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"sequences: every key must hold the same number of sequences, got {counts}")
    return data


def _lengths(data: dict[str, list[torch.Tensor]]) -> list[int]:
    keys = list(data)
    lens: list[int] = []
    for i in range(len(data[keys[0]])):
        seq_lens = {}
        for k in keys:
            t = data[k][i]
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                raise ValueError(f"sequences[{k!r}][{i}] must be a tensor with a token dimension first")
            seq_lens[k] = t.shape[0]
        if len(set(seq_lens.values())) != 1:
            raise ValueError(f"sequence {i} has different lengths per key: {seq_lens}")
        lens.append(next(iter(seq_lens.values())))
    return lens


def pack_sequences(
    sequences: Mapping[str, Sequence[torch.Tensor]] | Sequence[torch.Tensor],
    max_tokens: int | None = None,
    *,
    num_packs: int | None = None,
    min_packs: int = 1,
) -> list[Pack]:
    """Pack sequences (a list of 1-D+ tensors, or a dict of such lists sharing lengths,
    e.g. `{"input_ids": ..., "loss_mask": ..., "advantages": ...}`) into packs.

    Give `max_tokens` (the per-GPU token cap, `ppo_max_token_len_per_gpu`): the fewest
    packs that respect it, token sums balanced, at least `min_packs` (ranks agreeing on
    a count). Or give `num_packs`: exactly that many balanced packs, no cap.
    """
    if (max_tokens is None) == (num_packs is None):
        raise ValueError("pack_sequences: give exactly one of max_tokens or num_packs")
    data = _as_dict(sequences)
    lens = _lengths(data)
    if not lens:
        raise ValueError("sequences is empty: nothing to pack")
    if max_tokens is not None:
        parts = partition_by_token_cap(lens, max_tokens, min_parts=min_packs)
    else:
        parts = karmarkar_karp(lens, num_packs)  # type: ignore[arg-type]
    packs = []
    for part in parts:
        plens = torch.tensor([lens[i] for i in part], dtype=torch.long)
        cu = torch.zeros(len(part) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(plens, 0)
        total = int(cu[-1])
        starts = torch.repeat_interleave(cu[:-1].long(), plens)
        pos = torch.arange(total, dtype=torch.long) - starts
        first = data[next(iter(data))][part[0]]
        packs.append(
            Pack(
                indices=list(part),
                cu_seqlens=cu.to(first.device),
                position_ids=pos.to(first.device),
                max_seqlen=int(plens.max()),
                data={k: torch.cat([v[i] for i in part], dim=0) for k, v in data.items()},
            )
        )
    return packs


def unpack_sequences(values: Sequence[torch.Tensor], packs: Sequence[Pack]) -> list[torch.Tensor]:
    """Per-token outputs of each pack (`values[j]` is `[packs[j].num_tokens, ...]`, e.g.
    log-probs of a packed forward) -> per-sequence tensors in the original order."""
    if len(values) != len(packs):
        raise ValueError(f"values has {len(values)} entries but there are {len(packs)} packs")
    total = sum(len(p.indices) for p in packs)
    out: list[torch.Tensor | None] = [None] * total
    for j, (v, p) in enumerate(zip(values, packs)):
        if not isinstance(v, torch.Tensor) or v.dim() < 1 or v.shape[0] != p.num_tokens:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"values[{j}] must have {p.num_tokens} tokens first (pack {j}), got {shape}")
        for idx, piece in zip(p.indices, torch.split(v, p.seqlens, dim=0)):
            if not 0 <= idx < total or out[idx] is not None:
                raise ValueError(f"packs: sequence index {idx} is out of range or appears twice")
            out[idx] = piece
    return out  # type: ignore[return-value]
