"""Moving optimizer state between the device and the host (FSDP2 and Megatron offload).

Copies are blocking on purpose: a non-blocking device->host `.to("cpu")` allocates its
destination in pinned memory (cudaHostAlloc), and that allocation is what failed with
`CUDA error: invalid argument` when the Megatron trainer offloaded its optimizer at start-up on
the lent H200 machines (issue 15; the same error is reported for large or numerous pinned
allocations elsewhere). Offload runs between trainer calls, where a synchronous copy into
pageable memory costs nothing that matters.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def move_state(states: Iterable[dict], where: Any) -> None:
    """Every tensor in each optimizer state dict (Adam's exp_avg, exp_avg_sq, step ...) to `where`."""
    for state in states:
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(where)


def move_params(params: Iterable[torch.Tensor], where: Any) -> None:
    """Re-home parameters the optimizer owns (fp32 main copies) in place: the optimizer keeps the same objects."""
    for p in params:
        p.data = p.data.to(where)
