"""Seconds with at least one task running: the union of overlapping spans, not their sum.

Why: an engine serving 64 requests for 1 s was busy 1 s, not 64; and an engine that serves training
rollouts and validation at once was busy once, which `rollout/idle_ratio` must say.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator


class BusyClock:
    """Counts the time during which `start()` calls outnumber `stop()` calls."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._running = 0
        self._since = 0.0  # when the running count last went from 0 to 1
        self.closed_s = 0.0  # the busy spans that have ended

    def start(self) -> None:
        if self._running == 0:
            self._since = self._now()
        self._running += 1

    def stop(self) -> None:
        if self._running == 0:
            raise RuntimeError("BusyClock.stop() without a running task")
        self._running -= 1
        if self._running == 0:
            self.closed_s += self._now() - self._since

    @property
    def running(self) -> int:
        return self._running

    def seconds(self) -> float:
        """Busy seconds so far, the span still running included."""
        return self.closed_s + (self._now() - self._since if self._running else 0.0)

    @contextmanager
    def task(self) -> Iterator[None]:
        """One task's span (ended however the task ends, cancellation included)."""
        self.start()
        try:
            yield
        finally:
            self.stop()
