"""Which engine replicas still serve: K failed requests in a row take one out of rotation.

A request error (`GenerateResult.error`) is an engine saying "this request failed, I keep
serving", and one such error is retried. A replica whose requests keep failing is broken
(a wedged device, NaN logits everywhere, a bad weight load): retrying on it only delays
the end of the run while its groups are dropped. After `max_consecutive_failures` failed
requests in a row (any success resets the count) the replica leaves the rotation, is
logged and counted; when none is left the run stops with that replica's last error as
the cause (`EngineFailure`), instead of a progress bar that stays at 0.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

logger = logging.getLogger("verl_async.rollouter")


class EngineFailure(RuntimeError):
    """No engine replica is left to serve requests (every one failed K requests in a row)."""


class ReplicaHealth:
    """Consecutive request failures per replica, and the replicas taken out of rotation."""

    def __init__(self, count: int, max_consecutive_failures: int) -> None:
        if max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures must be >= 1, got {max_consecutive_failures}")
        self.count = count
        self.max_consecutive_failures = int(max_consecutive_failures)
        self.consecutive = [0] * count
        self.last_error: list[Optional[str]] = [None] * count
        self.out: dict[int, str] = {}  # replica -> why it left the rotation

    def record(self, index: int, error: Optional[str]) -> bool:
        """One finished request on `index` (error None: it served). True when this took the replica out."""
        if error is None:
            self.consecutive[index] = 0
            return False
        self.consecutive[index] += 1
        self.last_error[index] = error
        if index in self.out or self.consecutive[index] < self.max_consecutive_failures:
            return False
        self.out[index] = f"{self.consecutive[index]} failed requests in a row, last error: {error}"
        logger.error("engine replica %d taken out of rotation: %s; %d of %d replicas still serve",
                     index, self.out[index], self.count - len(self.out), self.count)
        return True

    def serving(self, candidates: Optional[Sequence[int]] = None) -> list[int]:
        """Replicas in rotation among `candidates`; all of them in rotation when none of those is."""
        healthy = [i for i in range(self.count) if i not in self.out]
        if candidates is None:
            return healthy
        preferred = [i for i in candidates if i not in self.out]
        return preferred or healthy

    @property
    def all_out(self) -> bool:
        return len(self.out) >= self.count

    def failure(self) -> EngineFailure:
        """The error that stops the run: every replica's own last error."""
        why = "; ".join(f"replica {i}: {self.out[i]}" for i in sorted(self.out))
        return EngineFailure(f"every engine replica is out of rotation ({why})")
