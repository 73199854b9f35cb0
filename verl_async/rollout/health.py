"""Which engine replicas still serve: K failed requests in a row take one out of rotation.

A request error (`GenerateResult.error`) is an engine saying "this request failed, I keep
serving", and one such error is retried. A replica whose requests keep failing is broken
(a wedged device, NaN logits everywhere, a bad weight load): retrying on it only delays
the end of the run while its groups are dropped. After `max_consecutive_failures` failed
requests in a row (any success resets the count) the replica leaves the rotation, is
logged and counted; when none is left the run stops with that replica's last error as
the cause (`EngineFailure`), instead of a progress bar that stays at 0.

With healing (rollout/healing.py) a replica that died or broke is `down` while it restarts:
out of rotation, but expected back (`back`); one that used up `rollout.max_replica_restarts`
is `out` for good. The run fails only when every replica is out and none is coming back.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from verl_async.errors import ReplicaLost  # noqa: F401 - what a lost replica raises, importable from here too

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
        self.out: dict[int, str] = {}  # replica -> why it left the rotation (for good)
        self.down: dict[int, str] = {}  # replica -> why it is being restarted (it comes back: `back`)

    def record(self, index: int, error: Optional[str], *, take_out: bool = True) -> bool:
        """One finished request on `index` (error None: it served). True when this reached the limit of failures in a
        row (the replica is then out of rotation, or with `take_out=False` left for the caller to heal)."""
        if error is None:
            self.consecutive[index] = 0
            return False
        self.consecutive[index] += 1
        self.last_error[index] = error
        if index in self.out or index in self.down or self.consecutive[index] < self.max_consecutive_failures:
            return False
        if take_out:
            self.retire(index, f"{self.consecutive[index]} failed requests in a row, last error: {error}")
        return True

    def failures_in_a_row(self, index: int) -> str:
        return f"{self.consecutive[index]} failed requests in a row, last error: {self.last_error[index]}"

    def take_down(self, index: int, why: str) -> bool:
        """`index` is restarting: out of rotation until `back`. False when it was down or out already."""
        if index in self.down or index in self.out:
            return False
        self.down[index] = why
        logger.warning("engine replica %d is down (%s); %d of %d replicas serve while it restarts",
                       index, why, len(self.serving()), self.count)
        return True

    def back(self, index: int) -> None:
        """`index` restarted with current weights: in rotation again, its failure count reset."""
        self.down.pop(index, None)
        self.consecutive[index] = 0

    def retire(self, index: int, why: str) -> None:
        """Out of rotation for good."""
        self.down.pop(index, None)
        self.out[index] = why
        logger.error("engine replica %d taken out of rotation: %s; %d of %d replicas still serve",
                     index, why, len(self.serving()), self.count)

    def serving(self, candidates: Optional[Sequence[int]] = None) -> list[int]:
        """Replicas in rotation among `candidates`; all of them in rotation when none of those is."""
        healthy = [i for i in range(self.count) if i not in self.out and i not in self.down]
        if candidates is None:
            return healthy
        preferred = [i for i in candidates if i not in self.out and i not in self.down]
        return preferred or healthy

    @property
    def healing(self) -> bool:
        """Some replica is restarting: a request with no replica to go to waits for it."""
        return bool(self.down)

    @property
    def all_out(self) -> bool:
        return len(self.out) >= self.count

    def failure(self) -> EngineFailure:
        """The error that stops the run: every replica's own last error."""
        why = "; ".join(f"replica {i}: {self.out[i]}" for i in sorted(self.out))
        return EngineFailure(f"every engine replica is out of rotation ({why})")
