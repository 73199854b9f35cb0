"""Moving optimizer state between the device and the host (FSDP2 and Megatron offload).

Two rules, both from the Megatron trainer's start-up failure on GPUs (issue 15,
`CUDA error: invalid argument` in the optimizer offload):

* An optimizer parameter that shares storage with the model (Megatron's distributed
  optimizer keeps fp32 model parameters, e.g. norm weights, as views into DDP's parameter
  buffer) is the model's, not the optimizer's: parameter offload frees and restores that
  buffer, so moving the view would read freed memory (the failure) and, coming back,
  would detach it from the buffer the model computes with. Only storage the optimizer
  owns (its fp32 main copies) moves.
* 0-dim state (Adam's `step`) stays where the optimizer keeps it: a non-capturable
  Adam wants it on the host, a fused/capturable one on the device.

Copies are blocking: offload runs between trainer calls, where a synchronous copy into
pageable memory costs nothing that matters, and no pinned (cudaHostAlloc) buffers pile up.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def move_state(states: Iterable[dict], where: Any) -> None:
    """Every non-scalar tensor in each optimizer state dict (Adam's exp_avg, exp_avg_sq ...) to `where`."""
    for state in states:
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(where)


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Data pointers of the storages behind `tensors` (0, a freed storage's, included)."""
    return {t.untyped_storage().data_ptr() for t in tensors}


def move_params(params: Iterable[torch.Tensor], where: Any, *, model_storages: set[int] = frozenset()) -> int:
    """Re-home the parameters the optimizer owns (fp32 main copies) in place; returns how many moved.

    The optimizer keeps the same objects. Parameters whose storage is in `model_storages`
    (see `storage_ptrs`) or already freed belong to the model and stay.
    """
    moved = 0
    for p in params:
        ptr = p.untyped_storage().data_ptr()
        if ptr == 0 or ptr in model_storages:
            continue
        p.data = p.data.to(where)
        moved += 1
    return moved
