"""verl's V1 off-policy accounting: how many model versions a trajectory spans (pure functions).

verl's V1 trainer (verl/trainer/ppo/v1/) numbers its weights by global step: step g trains with the
weights of version g - 1 and a prompt submitted at step k starts under version k - 1. Here the
trainer's `version` is that g - 1 and a group records the version it was admitted under
(`RolloutSample.param_version_start`) and the versions that sampled its tokens. So:

* span of a group trained at version v, admitted at version a: v - a + 1 (verl's
  `global_steps - prompt_global_steps + 1`), the quantity `trainer.v1.sampler.max_off_policy_threshold`
  bounds. `drop` drops a group whose span exceeds it: with the oldest token's version for a,
  `v - min_version > threshold - 1`, which is `algorithm.max_staleness = threshold - 1`
  (config/verl_v1.py); `wait` never drops: the trainer waits while a group still in flight has
  reached the threshold, then trains the oldest groups first (`must_wait`).
* per trajectory (one response) with token versions [m, M]: `trajectory_spans` = M - m + 1,
  `trajectory_staleness` = v - M, `trajectory_staleness_worst` = v - m (verl's
  `training/off_policy/*`, logged beside fully_async/staleness).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from verl_async.protocol import RolloutSample

PREFIX = "training/off_policy"


def span(trainer_version: int, admitted_version: int) -> int:
    """Model versions from a group's admission to the version training on it, both counted."""
    return trainer_version - admitted_version + 1


def must_wait(trainer_version: int, oldest_inflight_version: Optional[int], threshold: Optional[int]) -> bool:
    """`max_off_policy_strategy=wait`: hold the next step while a group in flight has reached the threshold
    (verl's `span >= threshold`), so that it is trained at that span instead of dropped."""
    if threshold is None or oldest_inflight_version is None:
        return False
    return span(trainer_version, oldest_inflight_version) >= threshold


def trajectory_metrics(groups: Sequence[RolloutSample], version: int) -> dict[str, float]:
    """verl's `training/off_policy/trajectory_{spans,staleness,staleness_worst}/{mean,max,min}` of a step's
    trajectories (responses; inserted multi-turn tokens have no version and do not count)."""
    lo, hi = [], []
    for group in groups:
        for response in group.responses:
            if response.model_tokens:
                lo.append(response.min_version)
                hi.append(response.max_version)
    if not lo:
        return {}
    m, big_m = np.asarray(lo, dtype=float), np.asarray(hi, dtype=float)
    out: dict[str, float] = {}
    for name, values in (("trajectory_spans", big_m - m + 1), ("trajectory_staleness", version - big_m),
                         ("trajectory_staleness_worst", version - m)):
        out[f"{PREFIX}/{name}/mean"] = float(values.mean())
        out[f"{PREFIX}/{name}/max"] = float(values.max())
        out[f"{PREFIX}/{name}/min"] = float(values.min())
    return out
