"""How far ahead the Rollouter may run (verl fully-async semantics, docs/architecture.md "Staleness").

    max_required_samples = required_samples * trigger_parameter_sync_step * (1 + staleness_threshold)

is the most groups the Rollouter may START per parameter version. After each sync the
count restarts at the groups still outstanding (in flight + waiting in the queue), so
that the backlog never exceeds the budget. With threshold 0 and trigger 1 this is
strictly on-policy: exactly `required_samples` groups per version, none started before
the next version's weights arrive.

It lives beside protocol.py and queue.py because it is the contract the Rollouter (the
budget), the config (derived.max_required_samples, the queue's default capacity), the
Trainer (max_staleness) and the simulator share; none of them owns it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def max_required_samples(required_samples: int, trigger_parameter_sync_step: int, staleness_threshold: float) -> int:
    if required_samples < 1 or trigger_parameter_sync_step < 1 or staleness_threshold < 0:
        raise ValueError(
            "max_required_samples needs required_samples >= 1, trigger_parameter_sync_step >= 1 and "
            f"staleness_threshold >= 0 (got {required_samples}, {trigger_parameter_sync_step}, {staleness_threshold})"
        )
    # floor with a small tolerance so 4 * 1 * (1 + 0.5) is 6, not 5.999.
    return int(math.floor(required_samples * trigger_parameter_sync_step * (1 + staleness_threshold) + 1e-9))


@dataclass
class StalenessBudget:
    """Counts groups started under the current version against `max_required_samples`."""

    limit: int
    started: int = 0

    def can_start(self) -> bool:
        return self.started < self.limit

    def on_start(self) -> None:
        self.started += 1

    def on_abandon(self) -> None:
        """A started group will never reach the queue (dropped): its slot is free again.

        Without this a dropped group holds its slot forever; with threshold 0 and trigger 1
        the trainer then waits for a group that never comes while the Rollouter waits here.
        """
        self.started = max(0, self.started - 1)

    def on_sync(self, outstanding: int) -> None:
        """New version: the count restarts at what is still in flight or queued."""
        self.started = max(0, outstanding)

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.started)


def exceeds_max_staleness(trainer_version: int, min_version: int, max_staleness: int | None) -> bool:
    """AReaL's eta: a group older than this is dropped (and counted) by the trainer."""
    return max_staleness is not None and trainer_version - min_version > max_staleness
