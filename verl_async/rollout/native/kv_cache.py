"""A contiguous per-slot KV cache that plugs into unmodified HF attention layers.

Layout per layer: K and V tensors `[num_slots, kv_heads, slot_len, head_dim]`. Every running
sequence owns one slot for its whole life, and the scheduler keeps the running sequences in
slots `0..B-1` (compacting when one leaves), so the decode batch's keys are a zero-copy
view `k[:B, :, :L]` that SDPA reads directly, the shapes are static per (B, L) bucket
(CUDA graphs) and nothing is ever allocated after start-up (no OOM mid-run by design).

HF attention layers call exactly one method on the cache they get (`cache=`, or `past_key_values=` on
older transformers): `update(k, v, layer_idx)`,
which must store the new keys/values and return the keys/values to attend to (transformers 4.x
models also ask `get_seq_length()` to derive a `cache_position` nothing here uses). This class
implements it for two modes the runner switches between before each forward:
- prefill: a right-padded batch of new sequences starting at position 0; keys are stored in
  the sequences' slots and attention runs on the new keys only (causal);
- decode: one new token per running sequence at its own position; attention reads the
  slot rows `0..B-1` up to `L`, masked per row to the sequence's length.
The attention masks are built here too (additive float, built once per forward and shared by the layers).
"""

from __future__ import annotations

from typing import Optional

import torch


class SlotKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        slot_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_slots, num_kv_heads, slot_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.slot_len = num_slots, slot_len
        self.rows = torch.arange(num_slots, device=device)
        self._mode: Optional[str] = None
        self._slots: Optional[torch.Tensor] = None  # prefill: slot of each batch row
        self._width = 0  # prefill: padded prompt length
        self._positions: Optional[torch.Tensor] = None  # decode: position of each row's new token
        self._kv_len = 0  # decode: keys attended to per row

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers (what one decode step reads per cached token)."""
        k = self.k[0]
        return 2 * len(self.k) * k.shape[1] * k.shape[3] * k.element_size()

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_slots * self.slot_len

    def set_prefill(self, slots: torch.Tensor, width: int) -> "SlotKVCache":
        self._mode, self._slots, self._width = "prefill", slots, width
        return self

    def set_decode(self, positions: torch.Tensor, kv_len: int) -> "SlotKVCache":
        """Rows 0..len(positions)-1 write their new token at `positions` and attend to keys [0, kv_len)."""
        self._mode, self._positions, self._kv_len = "decode", positions, kv_len
        return self

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        if self._mode == "prefill":
            k_cache[self._slots, :, : self._width] = key_states
            v_cache[self._slots, :, : self._width] = value_states
            return key_states, value_states
        if self._mode == "decode":
            rows = self.rows[: key_states.shape[0]]
            k_cache[rows, :, self._positions] = key_states[:, :, 0]
            v_cache[rows, :, self._positions] = value_states[:, :, 0]
            return k_cache[: rows.numel(), :, : self._kv_len], v_cache[: rows.numel(), :, : self._kv_len]
        raise RuntimeError("SlotKVCache.update called before set_prefill/set_decode")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Asked by transformers 4.x decoders when no `cache_position` is passed (5.x asks only without
        `position_ids`). Their `cache_position` only feeds mask creation, which the runner's ready 4D
        masks skip, and cache updates, which ignore it; positions come from `position_ids`."""
        return 0

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first `length` positions of slots `src` into slots `dst` (compaction)."""
        if not src:
            return
        device = self.rows.device
        src_t = torch.tensor(src, device=device)
        dst_t = torch.tensor(dst, device=device)
        for cache in (*self.k, *self.v):
            cache[dst_t, :, :length] = cache[src_t, :, :length]


def _to_mask_kind(allowed: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    if attn_implementation == "sdpa" and allowed.device.type == "npu":
        return allowed  # HF's SDPA path on Ascend wants bool masks (it inverts any other kind)
    # Additive masks. Eager adds them to the scores. SDPA turns a bool mask into exactly this
    # additive one (0 / -inf in the query dtype: torch's convert_boolean_attn_mask) in every
    # layer, i.e. ~4 more kernels per layer per step; built once here, the numbers are the same.
    fill = float("-inf") if attn_implementation == "sdpa" else torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, fill)


def _collapse(masks: dict[str, torch.Tensor], layer_types: list[str]):
    """One 4D mask when every layer has the same kind, else {kind: mask}.

    Every HF decoder passes a ready 4D mask through untouched; only models whose config
    lists mixed `layer_types` (Qwen2/Qwen3 with sliding layers, Gemma) take a dict. A model
    like Llama hands a dict straight to `create_causal_mask` and fails.
    """
    kinds = set(layer_types)
    if len(kinds) == 1:
        return masks[next(iter(kinds))]
    return masks


def prefill_masks(
    width: int,
    *,
    layer_types: list[str],
    sliding_window: Optional[int],
    attn_implementation: str,
    dtype: torch.dtype,
    device: torch.device,
):
    """Masks for a right-padded prefill: causal (valid queries never see padding on their right).

    Always materialised: a `None` mask would make HF build its own from `past_key_values`,
    which this cache does not model.
    """
    masks: dict[str, torch.Tensor] = {}
    q = torch.arange(width, device=device)
    for kind in set(layer_types):
        allowed = q[None, :] <= q[:, None]
        if kind == "sliding_attention" and sliding_window:
            allowed &= q[None, :] > q[:, None] - sliding_window
        masks[kind] = _to_mask_kind(allowed[None, None], attn_implementation, dtype)
    return _collapse(masks, layer_types)


def decode_masks(
    positions: torch.Tensor,
    kv_len: int,
    *,
    layer_types: list[str],
    sliding_window: Optional[int],
    attn_implementation: str,
    dtype: torch.dtype,
):
    """Row b attends to keys [0, positions[b]] (and within the window for sliding layers): [B, 1, 1, kv_len]."""
    keys = torch.arange(kv_len, device=positions.device)[None, :]
    pos = positions[:, None]
    masks: dict[str, torch.Tensor] = {}
    for kind in set(layer_types):
        allowed = keys <= pos
        if kind == "sliding_attention" and sliding_window:
            allowed = allowed & (keys > pos - sliding_window)
        masks[kind] = _to_mask_kind(allowed[:, None, None, :], attn_implementation, dtype)
    return _collapse(masks, layer_types)
