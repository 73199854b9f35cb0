"""Progress watchdog: requests on the engines and nothing produced for too long stops the run.

A wedged engine (a hung collective, a device that stopped without raising, a deadlocked
scheduler) holds its requests for ever. The Rollouter would wait on them for ever, and the
trainer's deadlock check stays quiet because groups are in flight. The watchdog polls every
replica's `stats().generated_tokens` and the Rollouter's own counters (tokens of returned
requests, finished groups); when none of them rose for `rollout.progress_timeout_s` while
requests were on the engines, the Rollouter fails with `EngineStalled`: one line naming each
replica that holds requests, its request ids and the key to raise.

With healing (rollout/healing.py) each replica also has a clock of its own: one that holds
requests and neither makes tokens nor returns a request for `progress_timeout_s` is hung, and is
handed to the healer (killed, restarted; its requests continue on the others) instead of the run
stopping. The run-wide clock still stops the run when nothing heals.

The clock runs only while requests are on the engines and no weight sync is under way (a
sync pauses generation on purpose and has a timeout of its own); it starts afresh after
each pause. A pause on the staleness budget stops admission, not generation: requests
already on the engines still have to produce tokens, so they stay watched (an on-policy run
is paused on its budget most of the time, and a wedge there would hang it).

The default timeout (`rollout.progress_timeout_s: null`) comes from the run's sizes:

    600 s + max_num_seqs * (prompt_length + response_length) / 1000 tokens/s

600 s covers start-up work that produces no token (compiling, CUDA-graph capture, the
first prefill); the second term is one replica recomputing every sequence it may hold at
full length (after a partial-rollout sync every continued response is prefilled again) at a
pessimistic 1000 tokens/s. Defaults (64 x (128 + 64)): 612 s; 256 x (2048 + 8192): 54 min.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping, Optional, Protocol, Sequence

START_UP_ALLOWANCE_S = 600.0
FLOOR_TOKENS_PER_S = 1000.0
MAX_POLL_S = 5.0
SHOWN_REQUESTS = 8  # request ids named per replica in the error


def default_progress_timeout_s(max_num_seqs: int, prompt_length: int, response_length: int) -> float:
    """The module docstring's formula: generous, so that only an engine that is stuck trips it."""
    return START_UP_ALLOWANCE_S + max_num_seqs * (prompt_length + response_length) / FLOOR_TOKENS_PER_S


def progress_timeout_s(configured: Optional[float], max_num_seqs: int, prompt_length: int, response_length: int) -> float:
    """`rollout.progress_timeout_s`, or the default from the sizes when it is null."""
    if configured is not None:
        return float(configured)
    return default_progress_timeout_s(max_num_seqs, prompt_length, response_length)


class EngineStalled(RuntimeError):
    """Requests were on the engines and no token and no group came for rollout.progress_timeout_s."""


class StallClock:
    """Seconds without progress while watched; progress is any counter rising above its best so far."""

    def __init__(self) -> None:
        self._best: dict[str, int] = {}
        self._since: Optional[float] = None

    def observe(self, now: float, watching: bool, counters: Mapping[str, int]) -> float:
        rose = False
        for key, value in counters.items():
            if key not in self._best or value > self._best[key]:
                self._best[key] = value
                rose = True
        if not watching:
            self._since = None
            return 0.0
        if rose or self._since is None:
            self._since = now
        return now - self._since


class Watched(Protocol):
    """What the watchdog reads of the Rollouter."""

    engines: Sequence[Any]
    counters: Any  # generated_tokens, finished_groups
    healer: Any  # None: a hung replica stops the run (the run-wide clock)
    returned_requests: Sequence[int]  # per replica: requests that came back

    @property
    def in_sync(self) -> bool: ...

    def requests_on_engines(self) -> list[dict[str, float]]: ...  # per replica: request id -> start (monotonic)

    def replica_lost(self, index: int, why: str, *, kill: bool = False, engine: Any = None) -> None: ...


class ProgressWatchdog:
    """Polls a Rollouter's engines and counters until cancelled; raises EngineStalled on a stall."""

    def __init__(self, rollouter: Watched, timeout_s: float, poll_s: Optional[float] = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"rollout.progress_timeout_s must be > 0, got {timeout_s}")
        self.rollouter = rollouter
        self.timeout_s = float(timeout_s)
        self.poll_s = float(poll_s) if poll_s is not None else min(MAX_POLL_S, self.timeout_s / 10)
        self.clock = StallClock()
        count = len(rollouter.engines)
        self.replica_clocks = [StallClock() for _ in range(count)]
        self.engine_tokens: list[Optional[int]] = [None] * count
        self._stats_error: list[Optional[str]] = [None] * count
        self._asked: list[Optional[tuple[float, asyncio.Future, Any]]] = [None] * count
        # one stats_async() call per replica at a time, awaited on the loop (a replica actor's is an actor call):
        # a wedged replica leaves one pending future here, never a blocked thread or event loop

    async def run(self) -> None:
        try:
            while True:
                self._ask_stats()
                await asyncio.sleep(self.poll_s)
                self._read_stats()
                ro = self.rollouter
                requests = ro.requests_on_engines()
                watching = any(requests) and not ro.in_sync
                self._heal_hung_replicas(requests)
                stalled_s = self.clock.observe(time.monotonic(), watching, self._progress())
                if stalled_s >= self.timeout_s:
                    raise EngineStalled(self.describe(stalled_s, requests))
        finally:
            for asked in self._asked:
                if asked is not None:
                    asked[1].cancel()

    def _progress(self) -> dict[str, int]:
        counters = self.rollouter.counters
        out = {"returned_tokens": int(counters.generated_tokens), "groups": int(counters.finished_groups)}
        out.update({f"replica{i}": n for i, n in enumerate(self.engine_tokens) if n is not None})
        return out

    def _heal_hung_replicas(self, requests: Sequence[Mapping[str, float]]) -> None:
        """A replica holding requests with no token and no returned request for the timeout goes to the healer."""
        ro = self.rollouter
        if getattr(ro, "healer", None) is None:
            return
        now = time.monotonic()
        for i, held in enumerate(requests):
            tokens = self.engine_tokens[i]
            progress = {"tokens": -1 if tokens is None else tokens, "returned": int(ro.returned_requests[i])}
            stalled_s = self.replica_clocks[i].observe(now, bool(held) and not ro.in_sync, progress)
            if stalled_s >= self.timeout_s:
                self.replica_clocks[i] = StallClock()
                ro.replica_lost(i, f"hung: it held {len(held)} request(s) and made no token for {stalled_s:.0f} s "
                                   f"(rollout.progress_timeout_s={self.timeout_s:g})", kill=True, engine=ro.engines[i])

    def _ask_stats(self) -> None:
        for i, engine in enumerate(self.rollouter.engines):
            if self._asked[i] is None:
                self._asked[i] = (time.monotonic(), asyncio.ensure_future(engine.stats_async()), engine)

    def _read_stats(self) -> None:
        for i, asked in enumerate(self._asked):
            if asked is None:
                continue
            since, future, engine = asked
            if engine is not self.rollouter.engines[i]:  # healed since: ask the new one
                self._asked[i] = None
                self.engine_tokens[i] = None
                continue
            if not future.done():
                self._stats_error[i] = f"its stats() has not answered for {time.monotonic() - since:.0f} s"
                continue
            self._asked[i] = None
            try:
                self.engine_tokens[i] = int(future.result().generated_tokens)
                self._stats_error[i] = None
            except Exception as exc:  # noqa: BLE001 - an unreachable replica is reported, not fatal here
                self._stats_error[i] = f"its stats() failed: {type(exc).__name__}: {exc}"

    def describe(self, stalled_s: float, requests: Sequence[Mapping[str, float]]) -> str:
        """One line: how long, which key to raise, and per replica holding requests what it holds."""
        now = time.monotonic()
        parts = []
        for i, held in enumerate(requests):
            if not held:
                continue
            ids = sorted(held, key=held.__getitem__)  # oldest first
            shown = ", ".join(ids[:SHOWN_REQUESTS]) + (f" and {len(ids) - SHOWN_REQUESTS} more"
                                                      if len(ids) > SHOWN_REQUESTS else "")
            tokens = self.engine_tokens[i]
            state = self._stats_error[i] or (f"its engine reports {tokens} tokens generated in all"
                                             if tokens is not None else "no engine stats yet")
            parts.append(f"replica {i} holds {len(ids)} request(s), the oldest for {now - held[ids[0]]:.0f} s, "
                         f"{state} ({shown})")
        total = sum(len(held) for held in requests)
        return (f"no token and no group for {stalled_s:.0f} s while {total} request(s) were on the engines; "
                f"the run stops (rollout.progress_timeout_s={self.timeout_s:g}: raise it if the engines are slow "
                f"rather than stuck): " + "; ".join(parts))
