"""MessageQueue: the only link between Rollouter and Trainer.

A bounded FIFO of complete groups (`RolloutSample`). It never drops: a put into a
full queue waits (back-pressure on the Rollouter), a get waits for enough groups or
a timeout. It is a plain asyncio class; `recipe` wraps it as an async Ray actor, and
tests drive it in-process.

With `keep_taken` (the trainer heals: healing/trainer.py) it also keeps the groups taken since
the last checkpoint the trainer published (`checkpointed`): a trainer restarted from that
checkpoint lost their updates, so `rewind` puts them back at the front, in the order they were
taken. Every group is then trained exactly once against the restored checkpoint.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Optional

from verl_async.protocol import RolloutSample


class QueueClosed(RuntimeError):
    """Put into a closed queue (the run is stopping)."""


@dataclass
class QueueStats:
    size: int
    capacity: int
    produced: int
    consumed: int
    closed: bool
    put_wait_s: float  # total time producers spent blocked on a full queue
    get_wait_s: float  # total time consumers spent waiting for groups


class MessageQueue:
    def __init__(self, capacity: int, group_size: Optional[int] = None, keep_taken: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"MessageQueue capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.group_size = group_size
        self.keep_taken = bool(keep_taken)
        self._taken: list[RolloutSample] = []  # taken since the last checkpoint (keep_taken)
        self._checkpoint: Optional[str] = None  # the checkpoint those groups are counted against (None: the start)
        self._items: collections.deque[RolloutSample] = collections.deque()
        self._cond = asyncio.Condition()
        self._closed = False
        self._produced = 0
        self._consumed = 0
        self._put_wait = 0.0
        self._get_wait = 0.0

    async def put(self, sample: RolloutSample, timeout: Optional[float] = None) -> None:
        """Append one complete group; waits while the queue is full.

        Raises QueueClosed if the queue is (or gets) closed, TimeoutError on timeout.
        """
        if self.group_size is not None:
            sample.validate(self.group_size)
        loop = asyncio.get_running_loop()
        start = loop.time()
        async with self._cond:
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: self._closed or len(self._items) < self.capacity), timeout
                )
            finally:
                self._put_wait += loop.time() - start
            if self._closed:
                raise QueueClosed("MessageQueue is closed")
            self._items.append(sample)
            self._produced += 1
            self._cond.notify_all()

    async def get_batch(self, count: int, timeout: Optional[float] = None,
                        oldest_first: bool = False) -> list[RolloutSample]:
        """Take exactly `count` groups in FIFO order (`oldest_first`: those admitted under the oldest weight
        version first, FIFO among equals: verl's V1 sampler order, verl_async/off_policy.py).

        Returns fewer only when the queue is closed and drained (the run's end);
        raises TimeoutError if `count` groups do not arrive in time (nothing is taken).
        """
        if count < 1:
            raise ValueError(f"get_batch count must be >= 1, got {count}")
        loop = asyncio.get_running_loop()
        start = loop.time()
        async with self._cond:
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: self._closed or len(self._items) >= count), timeout
                )
            finally:
                self._get_wait += loop.time() - start
            take = min(count, len(self._items))
            if oldest_first:
                order = sorted(range(len(self._items)), key=lambda i: (self._items[i].param_version_start, i))
                batch = [self._items[i] for i in order[:take]]
                chosen = set(order[:take])
                self._items = collections.deque(s for i, s in enumerate(self._items) if i not in chosen)
            else:
                batch = [self._items.popleft() for _ in range(take)]
            self._consumed += take
            if self.keep_taken:
                self._taken.extend(batch)
            self._cond.notify_all()
            return batch

    async def close(self) -> None:
        """No more puts; waiting getters return what is left."""
        async with self._cond:
            self._closed = True
            self._cond.notify_all()

    async def shutdown(self) -> None:
        await self.close()

    def size(self) -> int:
        return len(self._items)

    def stats(self) -> QueueStats:
        return QueueStats(
            size=len(self._items),
            capacity=self.capacity,
            produced=self._produced,
            consumed=self._consumed,
            closed=self._closed,
            put_wait_s=self._put_wait,
            get_wait_s=self._get_wait,
        )

    def snapshot(self) -> list[dict]:
        """The queued groups as plain dicts (for checkpoints: nothing lost on resume)."""
        return [s.to_dict() for s in self._items]

    async def restore(self, samples: list[dict], checkpoint: Optional[str] = None) -> None:
        """Put back groups from `checkpoint`, ahead of anything new (keeps FIFO order)."""
        async with self._cond:
            restored = [RolloutSample.from_dict(d) for d in samples]
            self._items.extendleft(reversed(restored))
            self._taken.clear()
            self._checkpoint = checkpoint
            self._cond.notify_all()

    def checkpointed(self, path: str) -> None:
        """The trainer published `path`: the groups taken so far are in it."""
        self._taken.clear()
        self._checkpoint = path

    async def rewind(self) -> dict:
        """The trainer restarts from the last checkpoint it published: the groups it took since go back to the front.

        Returns {"checkpoint": that checkpoint's path (None: the run's start), "groups": how many came back}.
        """
        async with self._cond:
            back = len(self._taken)
            self._items.extendleft(reversed(self._taken))
            self._consumed -= back
            self._taken = []
            self._cond.notify_all()
            return {"checkpoint": self._checkpoint, "groups": back}
