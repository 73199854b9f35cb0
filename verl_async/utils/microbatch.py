"""Batch concurrent single-item requests into one call on a model, off the event loop.

The Rollouter scores each group in a task of its own; a teacher or a reward model answers
faster per item in batches. `MicroBatcher.submit(item)` waits for its result while the
batcher gathers the items that arrive within `linger_s` of the first one (or until
`max_items` / `max_tokens` are reached), runs `fn(items)` in a worker thread (the event
loop keeps serving the engines) and hands each caller its result. Batches run one at a
time (one device). A batch that raises fails every caller in it with that error: the caller
decides (count it, score 0, retry).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    def __init__(self, fn: Callable[[Sequence[T]], Sequence[R]], *, max_items: int = 64,
                 max_tokens: Optional[int] = None, cost: Callable[[T], int] = lambda _: 1,
                 linger_s: float = 0.005) -> None:
        if max_items < 1:
            raise ValueError(f"MicroBatcher max_items must be >= 1, got {max_items}")
        self.fn, self.max_items, self.max_tokens, self.cost, self.linger_s = fn, max_items, max_tokens, cost, linger_s
        self._pending: list[tuple[T, asyncio.Future]] = []
        self._wake: Optional[asyncio.Event] = None
        self._runner: Optional[asyncio.Task] = None
        self.batches = 0  # calls of fn (tests, metrics)
        self.items = 0

    async def submit(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        if self._wake is None:
            self._wake = asyncio.Event()
        future: asyncio.Future = loop.create_future()
        self._pending.append((item, future))
        self._wake.set()
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run())
        return await future

    def _take(self) -> list[tuple[T, asyncio.Future]]:
        batch, tokens = [], 0
        while self._pending and len(batch) < self.max_items:
            cost = self.cost(self._pending[0][0])
            if batch and self.max_tokens is not None and tokens + cost > self.max_tokens:
                break
            batch.append(self._pending.pop(0))
            tokens += cost
        return batch

    async def _run(self) -> None:
        while self._pending:
            if len(self._pending) < self.max_items and self.linger_s > 0:
                await asyncio.sleep(self.linger_s)  # let the items of concurrent callers arrive
            batch = [(item, fut) for item, fut in self._take() if not fut.cancelled()]
            if not batch:
                continue
            try:
                results = await asyncio.to_thread(self.fn, [item for item, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"batched call returned {len(results)} results for {len(batch)} items")
            except BaseException as exc:  # noqa: BLE001 - every caller of the batch gets it
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.batches += 1
            self.items += len(batch)
            for (_, fut), result in zip(batch, results):
                if not fut.done():
                    fut.set_result(result)


def chunks(costs: Sequence[int], max_items: int, max_tokens: Optional[int]) -> list[list[int]]:
    """Indices of `costs` (e.g. padded lengths, sorted by the caller) cut into runs of at most `max_items` items
    and `max_tokens` x items padded tokens (one item may exceed it alone)."""
    out: list[list[int]] = []
    current: list[int] = []
    widest = 0
    for i, cost in enumerate(costs):
        w = max(widest, cost)
        if current and (len(current) >= max_items or (max_tokens is not None and w * (len(current) + 1) > max_tokens)):
            out.append(current)
            current, w = [], cost
        current.append(i)
        widest = w
    if current:
        out.append(current)
    return out


__all__: list[Any] = ["MicroBatcher", "chunks"]
