"""Waiting on Ray refs under a deadline, so a dead or stuck actor fails the caller instead of hanging it
(and the error names the config key that sets the deadline)."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Hashable, Iterator, Mapping


class WaitTimeout(Exception):
    """The deadline passed; `pending` names the refs that had not finished (sorted)."""

    def __init__(self, pending: list) -> None:
        super().__init__(f"not finished: {pending}")
        self.pending = pending


def finished_in_turn(refs: Mapping[Hashable, Any], timeout_s: float) -> Iterator[tuple[Hashable, Any, float]]:
    """Yield (key, ref, seconds left) as each ref finishes; raise WaitTimeout at the deadline.

    The caller `ray.get`s each ref itself, so that it can name the failing member in its own words.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    key_of = {ref: key for key, ref in refs.items()}
    pending = list(refs.values())
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeout(sorted(key_of[r] for r in pending))
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            yield key_of[ref], ref, max(1.0, deadline - time.monotonic())


class KeyedTimeout(TimeoutError):
    """One call did not answer within its deadline; the message names the config key that sets it."""


def get_within(ref: Any, timeout_s: float, what: str, key: str) -> Any:
    """`ray.get(ref)` for at most `timeout_s`; past it a KeyedTimeout saying what did not answer and which key to raise."""
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise KeyedTimeout(f"{what} did not answer within {timeout_s:g} s (stuck or dead; raise {key} if it is "
                           "only slow)") from None


def resolve(ref: Any, timeout_s: float | None = None) -> Any:
    """The value of `ref`, as `ray.get(ref, timeout=timeout_s)` gives it, but through the ref's future.

    Ray warns ("Using blocking ray.get inside async actor") about every `ray.get` in an asyncio actor's
    process, also from a worker thread or its `__init__`, where blocking the calling thread is the point
    (an engine's weight-loading thread, a replica start awaited before the loop serves). A future's
    `result` blocks only the calling thread and is no `ray.get`. A timeout raises Ray's GetTimeoutError,
    so callers catch what they caught before.
    """
    import ray

    try:
        return ref.future().result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise ray.exceptions.GetTimeoutError(f"{ref} did not finish within {timeout_s} s") from None
