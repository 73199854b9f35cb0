"""A tool call's own time, apart from the time it waited for a slot (issue 36, defect 9).

A tool that limits how many of its calls run at once (`rate_limit`) makes the others wait.
That wait is not the call's running time: the agent loop's `multi_turn.tool_timeout_s`
counts only the time outside `queued()`, so the same code does not "time out" under load.

    async with self.slots.held():  # in the tool (ToolSlots): the wait for a slot is queued()
        ...                          # the call's own work

The agent loop (rollout/tool_session.py) starts a `CallClock` per call; outside a call
`queued()` does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from typing import AsyncIterator, Optional


class CallClock:
    """Running time of one call: wall time since `start` less the time spent in `queued()` blocks."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.queued_s = 0.0
        self._waiting = 0  # queued() blocks open now (a call's parallel parts may each wait)
        self._since = 0.0

    def enter(self) -> None:
        if self._waiting == 0:
            self._since = time.monotonic()
        self._waiting += 1

    def leave(self) -> None:
        self._waiting -= 1
        if self._waiting == 0:
            self.queued_s += time.monotonic() - self._since

    @property
    def waiting(self) -> bool:
        return self._waiting > 0

    def queued_total(self, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        return self.queued_s + (now - self._since if self._waiting else 0.0)

    def running(self, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        return now - self.start - self.queued_total(now)


_CLOCK: contextvars.ContextVar[Optional[CallClock]] = contextvars.ContextVar("verl_async_tool_call_clock",
                                                                             default=None)


def current_clock() -> Optional[CallClock]:
    return _CLOCK.get()


def set_clock(clock: CallClock) -> None:
    """Called inside the task that runs one call (a task's context is its own copy)."""
    _CLOCK.set(clock)


@contextlib.asynccontextmanager
async def queued() -> AsyncIterator[None]:
    """Mark the time inside as waiting for a slot, not running."""
    clock = _CLOCK.get()
    if clock is not None:
        clock.enter()
    try:
        yield
    finally:
        if clock is not None:
            clock.leave()


class ToolSlots:
    """`size` calls of a tool at once (its `rate_limit`); the wait for a slot counts as `queued()`.

    The semaphore belongs to the running event loop: a tool may outlive one loop (tests, a restarted actor).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._semaphore: Optional[asyncio.Semaphore] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def _on_this_loop(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._loop is not loop:
            self._semaphore, self._loop = asyncio.Semaphore(self.size), loop
        return self._semaphore

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        semaphore = self._on_this_loop()
        async with queued():
            await semaphore.acquire()
        try:
            yield
        finally:
            semaphore.release()
