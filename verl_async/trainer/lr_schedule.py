"""Learning-rate schedules with verl's semantics (constant / cosine, both with linear warmup).

The scheduler steps once per training step (one `update()` call), like verl's actor,
so `total_training_steps` and the warmup are counted in trainer steps.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(step: int, *, kind: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0,
              num_cycles: float = 0.5) -> float:
    """Multiplier of the base lr at `step` (0-based); a pure function so tests read the curve directly."""
    if kind == "constant":
        if step < warmup_steps:
            return float(step) / float(max(1, warmup_steps))
        return 1.0
    if kind == "cosine":
        if step < warmup_steps:
            return min_lr_ratio + (1.0 - min_lr_ratio) * float(step) / float(max(1, warmup_steps))
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        x = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
        return max(min_lr_ratio, x * (1.0 - min_lr_ratio) * 0.5 + (1.0 + min_lr_ratio) * 0.5)
    raise ValueError(f"actor_rollout_ref.actor.optim.lr_scheduler_type must be constant or cosine, got {kind!r}")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, kind: str, warmup_steps: int, total_steps: int,
                       min_lr_ratio: float = 0.0, num_cycles: float = 0.5) -> LambdaLR:
    return LambdaLR(
        optimizer,
        lambda step: lr_factor(step, kind=kind, warmup_steps=warmup_steps, total_steps=total_steps,
                               min_lr_ratio=min_lr_ratio, num_cycles=num_cycles),
    )
