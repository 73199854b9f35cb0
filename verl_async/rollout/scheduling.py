"""Rollout scheduling policies by name: `plain`, or `pdsr` when async_training.long_tail.enable=true.

The Rollouter takes the policy CLASS from whoever builds it (RolloutService, scripts, tests):
P-DSR needs the Rollouter's types, so the name -> class table lives here, above both, and
neither module imports the other's policy by name.
"""

from __future__ import annotations

from typing import Callable

from verl_async.rollout.pdsr_policy import PDSRPolicy
from verl_async.rollout.rollouter import PlainPolicy, SchedulingPolicy

SCHEDULING_POLICIES: dict[str, Callable[..., SchedulingPolicy]] = {"plain": PlainPolicy, "pdsr": PDSRPolicy}


def policy_class(name: str) -> Callable[..., SchedulingPolicy]:
    if name not in SCHEDULING_POLICIES:
        raise ValueError(f"unknown rollout scheduling policy {name!r}; available: {sorted(SCHEDULING_POLICIES)}")
    return SCHEDULING_POLICIES[name]
