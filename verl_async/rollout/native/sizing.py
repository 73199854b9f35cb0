"""How many sequences the native engine runs at once when `actor_rollout_ref.rollout.max_num_seqs` is null.

On CUDA the slots come from memory, as vLLM sizes its batch: the engine may hold
`gpu_memory_utilization` of the device's total memory (its weights, the KV cache, the decode step's
logits and activations), never more than is free when it starts (a colocated trainer's share stays
the trainer's). The KV cache gets what is left after the weights and a reserve for the step's own
tensors; each slot holds `max_model_len` tokens of every layer's K and V. At most MAX_AUTO_SLOTS:
a validation pass of a few hundred prompts then runs as one wave, not in 64-wide ones that the next
weight sync waits for (issue 42: validation held the trainer 39% of the README command's window at
64 slots, 6% at 256). Elsewhere (CPU, NPU) null means DEFAULT_MAX_NUM_SEQS.
"""

from __future__ import annotations

DEFAULT_MAX_NUM_SEQS = 64  # what null means off CUDA (and what every config had before)
MAX_AUTO_SLOTS = 512  # the most slots sizing from memory gives (one wave of a 500-prompt validation)
STEP_RESERVE = 0.1  # of the engine's share, kept for the step's activations, logits, sampling and graphs


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def auto_slots(*, free_bytes: int, total_bytes: int, weight_bytes: int, gpu_memory_utilization: float,
               bytes_per_token: int, max_model_len: int, cap: int = MAX_AUTO_SLOTS) -> tuple[int, str]:
    """(slots, why in words) for an engine whose weights are already on a device with `free_bytes` free.

    The engine's share is `gpu_memory_utilization x total`, at most the free memory plus its own weights
    (already counted as used); its KV budget is that share less the weights and STEP_RESERVE of the share.
    """
    share = min(gpu_memory_utilization * total_bytes, free_bytes + weight_bytes)
    kv_budget = share * (1.0 - STEP_RESERVE) - weight_bytes
    per_slot = bytes_per_token * max_model_len
    slots = max(1, min(int(cap), int(kv_budget // per_slot))) if kv_budget > 0 else 1
    gib = 1 << 30
    why = (f"{slots} slots of {max_model_len} tokens ({slots * per_slot / gib:.2f} GiB of KV cache) sized from "
           f"memory: gpu_memory_utilization={gpu_memory_utilization:g} of {total_bytes / gib:.1f} GiB, "
           f"{free_bytes / gib:.1f} GiB free, weights {weight_bytes / gib:.2f} GiB"
           + (f"; capped at {cap}" if slots == cap else ""))
    return slots, why
