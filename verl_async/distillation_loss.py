"""verl's `distillation.distillation_loss.*` as the loss reads them (torch-free: validation builds it before any
heavy import; the math is verl_async/algos/distillation.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK_MODES = ("forward_kl_topk",)


@dataclass(frozen=True)
class DistillationLoss:
    """verl's `distillation.distillation_loss.*` (the keys the loss reads)."""

    loss_mode: str = "k3"
    topk: Optional[int] = None
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: Optional[float] = None
    log_prob_min_clamp: Optional[float] = None
    use_policy_gradient: bool = False
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __post_init__(self) -> None:
        if self.loss_mode not in ESTIMATOR_MODES + TOPK_MODES:
            raise ValueError(f"distillation loss_mode must be one of {ESTIMATOR_MODES + TOPK_MODES}, got "
                             f"{self.loss_mode!r}")

    @property
    def uses_topk(self) -> bool:
        return self.loss_mode in TOPK_MODES
