"""The data path: which rows each DP rank forwards, in which micro-batches, in which layout.

Pure functions over the train batch of `verl_async.protocol.collate_groups` (left-padded
`prompts` [B,P], right-padded `responses` [B,T], `attention_mask` [B,P+T]); no model,
no Ray, no process group, so the plans are unit-tested alone and the driver (worker
group) computes them once for all ranks.

* Rows are split over DP ranks balanced by tokens (Karmarkar-Karp), then into
  micro-batches: a token budget per micro-batch (`use_dynamic_bsz`) or a fixed count.
  Every rank gets the SAME number of micro-batches (an empty list is a dummy
  micro-batch that still runs forward/backward, contributing zero), because FSDP's
  collectives need every rank in every forward and backward.
* `build_model_inputs` turns a micro-batch into model inputs, either padded (rows as
  they are, trimmed to the columns some row uses) or packed (padding-free: one row,
  sequences back to back, `position_ids` restarting per sequence, `cu_seqlens`), and
  records where each response token's log-prob lands in the [b, T] response matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import torch

from verl_async.algos import karmarkar_karp, partition_by_token_cap

if TYPE_CHECKING:  # tensordict (and torch._dynamo under it) loads with the first batch, not at start-up
    from tensordict import TensorDict

# Keys every call needs (collate_groups layout) and the extra keys of `update`.
LAYOUT_KEYS = ("prompts", "responses", "attention_mask", "response_mask")
UPDATE_KEYS = LAYOUT_KEYS + ("old_log_probs", "advantages", "group_index")

Plan = list[list[list[int]]]  # [rank][micro-batch] -> batch row indices (empty: dummy micro-batch)


def check_batch(batch: TensorDict, keys: Iterable[str], call: str) -> int:
    """Refuse an empty batch or missing keys, naming the call and the keys."""
    if batch is None or len(batch.batch_size) == 0 or batch.batch_size[0] == 0:
        raise ValueError(f"{call}: empty batch (0 rows)")
    missing = [k for k in keys if k not in batch.keys()]
    if missing:
        raise KeyError(f"{call}: batch lacks key(s) {missing}; it has {sorted(batch.keys())}")
    return int(batch.batch_size[0])


def sequence_lengths(batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt tokens, response tokens) per row, from the attention mask (the layout, not the loss mask)."""
    p = batch["prompts"].shape[1]
    am = batch["attention_mask"]
    return am[:, :p].sum(dim=1).long(), am[:, p:].sum(dim=1).long()


def check_lengths(prompt_lens: torch.Tensor, response_lens: torch.Tensor, max_tokens: Optional[int],
                  key: str) -> list[int]:
    """Total tokens per row; a clear error for an empty prompt or a row over the token budget."""
    empty = (prompt_lens == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"row {empty[0]} has an empty prompt: the first response token has no log-prob")
    totals = (prompt_lens + response_lens).tolist()
    if max_tokens is not None:
        for i, n in enumerate(totals):
            if n > max_tokens:
                raise ValueError(
                    f"row {i} has {n} tokens (prompt {int(prompt_lens[i])} + response {int(response_lens[i])}), "
                    f"more than {key}={max_tokens}: raise {key} to at least {n} or shorten responses"
                )
    return totals


def balanced_split(indices: Sequence[int], weights: Sequence[int], k: int, *, equal_size: bool) -> list[list[int]]:
    """Split `indices` into k parts with balanced sum of `weights[i]` (sorted within each part)."""
    indices = list(indices)
    if k <= 0:
        raise ValueError(f"balanced_split: k must be positive, got {k}")
    if len(indices) <= k:
        return [[i] for i in indices] + [[] for _ in range(k - len(indices))]
    equal = equal_size and len(indices) % k == 0
    parts = karmarkar_karp([int(weights[i]) for i in indices], k, equal_size=equal)
    return sorted((sorted(indices[j] for j in part) for part in parts), key=lambda p: (p[0] if p else math.inf))


def _micro_by_count(rows: list[int], size: int) -> list[list[int]]:
    return [rows[s : s + size] for s in range(0, len(rows), size)]


def _micro_by_tokens(rows: list[int], weights: Sequence[int], k: int, max_tokens: int) -> list[list[int]]:
    """The fewest (at least k) balanced parts within `max_tokens` (every single row fits: checked before)."""
    if k >= len(rows):
        return [[i] for i in rows]
    parts = partition_by_token_cap([int(weights[i]) for i in rows], max_tokens, min_parts=k)
    return sorted((sorted(rows[j] for j in part) for part in parts), key=lambda p: p[0])


def plan_micro_batches(rank_rows: list[list[int]], weights: Sequence[int], *, dynamic: bool, micro_size: int,
                       max_tokens: int) -> Plan:
    """Micro-batches per rank, the same count on every rank (dummies pad the short ranks)."""
    if dynamic:
        k = 1
        while True:
            plan = [_micro_by_tokens(rows, weights, k, max_tokens) for rows in rank_rows]
            most = max(len(p) for p in plan)
            if most <= k:
                break
            k = most  # some rank needs more parts: ask every rank for as many (balances them too)
    else:
        plan = [_micro_by_count(rows, micro_size) for rows in rank_rows]
    count = max(len(p) for p in plan)
    return [p + [[] for _ in range(count - len(p))] for p in plan]


def plan_forward(weights: Sequence[int], dp: int, *, dynamic: bool, micro_size: int, max_tokens: int) -> Plan:
    """Log-prob recompute: all rows over `dp` ranks, then micro-batches."""
    rank_rows = balanced_split(range(len(weights)), weights, dp, equal_size=not dynamic)
    return plan_micro_batches(rank_rows, weights, dynamic=dynamic, micro_size=micro_size, max_tokens=max_tokens)


@dataclass
class MiniBatchPlan:
    """One optimizer step: micro-batches per rank plus the mini-batch-wide loss normalisers."""

    micro: Plan
    num_tokens: float  # valid (loss-mask) response tokens in the whole mini-batch, all ranks
    num_seqs: float  # rows with at least one valid response token
    epoch: int = 0
    rows: list[int] = field(default_factory=list)


def group_order(group_index: torch.Tensor) -> list[int]:
    """Group ids in order of first appearance."""
    seen: dict[int, None] = {}
    for g in group_index.tolist():
        seen.setdefault(int(g), None)
    return list(seen)


def plan_update(group_index: torch.Tensor, weights: Sequence[int], loss_mask: torch.Tensor, *, mini_groups: int,
                epochs: int, shuffle: bool, seed: int, dp: int, dynamic: bool, micro_size: int,
                max_tokens: int) -> list[MiniBatchPlan]:
    """PPO's loop as data: `epochs` passes, each over mini-batches of `mini_groups` whole groups.

    A group never straddles two mini-batches (GRPO's unit). With `shuffle`, the group
    order of each epoch is a permutation drawn from `seed` (callers pass a seed that
    changes per training step), so the plan is a pure function of its arguments.
    """
    groups = group_order(group_index)
    rows_of: dict[int, list[int]] = {g: [] for g in groups}
    for i, g in enumerate(group_index.tolist()):
        rows_of[int(g)].append(i)
    row_tokens = loss_mask.sum(dim=-1)
    plans: list[MiniBatchPlan] = []
    for epoch in range(epochs):
        order = groups
        if shuffle:
            gen = torch.Generator().manual_seed(int(seed) * 1009 + epoch)
            order = [groups[j] for j in torch.randperm(len(groups), generator=gen).tolist()]
        for s in range(0, len(order), mini_groups):
            rows = sorted(i for g in order[s : s + mini_groups] for i in rows_of[g])
            rank_rows = balanced_split(rows, weights, dp, equal_size=not dynamic)
            micro = plan_micro_batches(rank_rows, weights, dynamic=dynamic, micro_size=micro_size,
                                       max_tokens=max_tokens)
            sel = row_tokens[rows]
            plans.append(MiniBatchPlan(micro=micro, num_tokens=float(sel.sum()), num_seqs=float((sel > 0).sum()),
                                       epoch=epoch, rows=rows))
    return plans


@dataclass
class ModelInputs:
    """One micro-batch ready for the model, and how to read its log-probs back.

    The model is called as `model(input_ids=..., position_ids=..., attention_mask=...,
    logits_to_keep=logits_index, use_cache=False, **varlen_kwargs)`; logits come back
    as [r, K, V] for the kept positions, `labels` [r, K] are the tokens they predict.
    `scatter(values [r, K]) -> [b, T]` places them in the response matrix (0 elsewhere).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    logits_index: torch.Tensor
    labels: torch.Tensor
    src: torch.Tensor  # flat index into [r*K] of each valid response token
    dst_row: torch.Tensor  # its row in [b, T]
    dst_col: torch.Tensor  # its column in [b, T]
    num_rows: int  # b (0 for a dummy micro-batch)
    width: int  # T
    varlen_kwargs: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device) -> "ModelInputs":
        move = lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return ModelInputs(
            input_ids=move(self.input_ids), position_ids=move(self.position_ids),
            attention_mask=move(self.attention_mask), logits_index=move(self.logits_index),
            labels=move(self.labels), src=move(self.src), dst_row=move(self.dst_row), dst_col=move(self.dst_col),
            num_rows=self.num_rows, width=self.width,
            varlen_kwargs={k: move(v) for k, v in self.varlen_kwargs.items()},
        )

    def model_kwargs(self) -> dict:
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=self.attention_mask,
                    logits_to_keep=self.logits_index, use_cache=False, **self.varlen_kwargs)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros((self.num_rows, self.width))
        if self.src.numel():
            out = out.index_put((self.dst_row, self.dst_col), values.reshape(-1)[self.src])
        return out


def dummy_inputs(pad_token_id: int, width: int) -> ModelInputs:
    """A one-token forward that contributes nothing: keeps a rank in step with the others."""
    one = torch.tensor([[pad_token_id]], dtype=torch.long)
    empty = torch.zeros(0, dtype=torch.long)
    return ModelInputs(input_ids=one, position_ids=torch.zeros_like(one), attention_mask=None,
                       logits_index=torch.zeros(1, dtype=torch.long), labels=one.clone(), src=empty,
                       dst_row=empty, dst_col=empty, num_rows=0, width=width)


def build_model_inputs(batch: TensorDict, rows: Sequence[int], *, packed: bool, pad_token_id: int,
                       with_varlen_kwargs: bool = False) -> ModelInputs:
    """Model inputs for `rows` of the batch, padded or packed (see module docstring)."""
    width = batch["responses"].shape[1]
    if not rows:
        return dummy_inputs(pad_token_id, width)
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    prompts, responses = batch["prompts"][idx], batch["responses"][idx]
    am = batch["attention_mask"][idx]
    P = prompts.shape[1]
    p_len = am[:, :P].sum(dim=1).long()
    r_len = am[:, P:].sum(dim=1).long()
    b = len(rows)
    if packed:
        seqs, positions, keep, labels, dst_row, dst_col = [], [], [], [], [], []
        offset = 0
        for i in range(b):
            p, r = int(p_len[i]), int(r_len[i])
            seqs.append(torch.cat([prompts[i, P - p :], responses[i, :r]]))
            positions.append(torch.arange(p + r))
            keep.append(torch.arange(offset + p - 1, offset + p - 1 + r))
            labels.append(responses[i, :r])
            dst_row.append(torch.full((r,), i, dtype=torch.long))
            dst_col.append(torch.arange(r))
            offset += p + r
        lens = (p_len + r_len).to(torch.int32)
        cu = torch.zeros(b + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        keep_t = torch.cat(keep)
        varlen = {}
        if with_varlen_kwargs:
            max_len = int(lens.max())
            varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
        return ModelInputs(
            input_ids=torch.cat(seqs).unsqueeze(0), position_ids=torch.cat(positions).unsqueeze(0),
            attention_mask=None, logits_index=keep_t, labels=torch.cat(labels).unsqueeze(0),
            src=torch.arange(keep_t.numel()), dst_row=torch.cat(dst_row), dst_col=torch.cat(dst_col),
            num_rows=b, width=width, varlen_kwargs=varlen,
        )
    # padded: keep the columns some row uses; response token j of a row is predicted at column maxp - 1 + j
    maxp, maxr = int(p_len.max()), max(int(r_len.max()), 1)
    cols = slice(P - maxp, P + maxr)
    input_ids = torch.cat([prompts, responses], dim=1)[:, cols]
    mask = am[:, cols]
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    valid = am[:, P : P + maxr].bool()
    rr, cc = valid.nonzero(as_tuple=True)
    return ModelInputs(
        input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
        logits_index=torch.arange(maxp - 1, maxp - 1 + maxr), labels=responses[:, :maxr],
        src=rr * maxr + cc, dst_row=rr, dst_col=cc, num_rows=b, width=width,
    )


def gather_rows(batch: TensorDict, rows: Sequence[int], keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """Per-row tensors of a micro-batch ([b, T] loss inputs), in `rows` order."""
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    return {k: batch[k][idx] for k in keys}


def build_right_padded_inputs(batch: TensorDict, rows: Sequence[int], *, pad_token_id: int,
                              multiple_of: int = 1) -> ModelInputs:
    """Rows as `[prompt tokens, response tokens, pad...]`, positions 0..L-1, no attention mask.

    For models that take positions from the token index (Megatron's RoPE ignores
    `position_ids`) and run plain causal attention: with every row's padding at its
    end, causal masking alone is exact. `logits_index` covers the columns from the
    first response prediction on; `labels` are the next tokens there. Lengths are
    padded to a multiple of `multiple_of` (sequence parallelism splits them).
    """
    width = batch["responses"].shape[1]
    if not rows:
        return dummy_inputs(pad_token_id, width)
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    prompts, responses, am = batch["prompts"][idx], batch["responses"][idx], batch["attention_mask"][idx]
    P = prompts.shape[1]
    p_len, r_len = am[:, :P].sum(dim=1).long(), am[:, P:].sum(dim=1).long()
    b = len(rows)
    length = int((p_len + r_len).max())
    length = -(-length // multiple_of) * multiple_of
    input_ids = torch.full((b, length), pad_token_id, dtype=prompts.dtype)
    for i in range(b):
        p, r = int(p_len[i]), int(r_len[i])
        input_ids[i, :p] = prompts[i, P - p:]
        input_ids[i, p:p + r] = responses[i, :r]
    start = int(p_len.min()) - 1  # first column whose logits predict a response token
    keep = torch.arange(start, length - 1)
    labels = input_ids[:, start + 1:]
    valid = am[:, P:P + width].bool()
    rr, cc = valid.nonzero(as_tuple=True)
    src = rr * keep.numel() + (p_len[rr] - 1 + cc - start)
    return ModelInputs(
        input_ids=input_ids, position_ids=torch.arange(length).unsqueeze(0).expand(b, -1).contiguous(),
        attention_mask=None, logits_index=keep, labels=labels, src=src, dst_row=rr, dst_col=cc, num_rows=b,
        width=width,
    )
