"""One rollout replica as a fluid continuous-batching model.

Every running sequence advances at ``speed.tokens_per_s(batch)`` tokens/s, so the
replica keeps one progress clock (tokens each running sequence has gained since
the replica started) and a heap of the clock values at which jobs finish: an
event costs O(log batch) however many sequences run. Admission is bounded by
``max_num_seqs`` and a KV budget in tokens (each job carries its reservation).
Prefill time is not modelled (decode dominates long-tail rollouts).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from verl_async.sim.speed import SpeedModel

_REL_EPS = 1e-9


@dataclass(eq=False)
class Job:
    """One generation request: ``need`` tokens to generate on one replica."""

    group: int             # simulator group id
    response: int          # index of the response in its group
    need: int              # tokens to generate in this segment
    kv: int                # KV tokens reserved while running
    kind: str              # plain | probe | heavy | fast | moved
    prefix: int = 0        # tokens of the response generated before this segment
    cap: int | None = None  # max_tokens of a fast segment
    admitted: float | None = None
    replica: int | None = None
    version: int | None = None  # param version at admission
    prev: "Job | None" = None   # the earlier segment of a moved response


@dataclass
class Replica:
    index: int
    speed: SpeedModel
    max_num_seqs: int
    kv_budget: int | None
    pools: tuple[str, ...]            # pools it takes work from, in priority order
    clock: float = 0.0
    t: float = 0.0
    kv_used: int = 0
    paused: bool = False
    busy_time: float = 0.0
    seq_time: float = 0.0             # integral of running sequences over busy time
    spans: list[tuple[float, float]] = field(default_factory=list)
    _heap: list = field(default_factory=list)
    _seq: itertools.count = field(default_factory=itertools.count)
    _busy_since: float | None = None

    @property
    def active(self) -> int:
        return len(self._heap)

    def rate(self) -> float:
        if self.paused or not self._heap:
            return 0.0
        return self.speed.tokens_per_s(len(self._heap))

    def fits(self, job: Job) -> bool:
        if self.paused or len(self._heap) >= self.max_num_seqs:
            return False
        return self.kv_budget is None or self.kv_used + job.kv <= self.kv_budget

    def admit(self, job: Job, t: float, version: int) -> None:
        job.admitted, job.replica, job.version = t, self.index, version
        self.kv_used += job.kv
        heapq.heappush(self._heap, (self.clock + job.need, next(self._seq), job))

    def next_event_time(self) -> float:
        r = self.rate()
        if not self._heap:
            return math.inf
        if r == 0.0:
            return math.inf
        return self.t + max(0.0, self._heap[0][0] - self.clock) / r

    def advance(self, t: float) -> None:
        dt = t - self.t
        if dt < 0:
            raise RuntimeError(f"replica {self.index}: time went back from {self.t} to {t}")
        r = self.rate()
        if r > 0:
            self.clock += r * dt
            self.busy_time += dt
            self.seq_time += len(self._heap) * dt
        self.t = t

    def pop_done(self) -> list[Job]:
        done = []
        while self._heap and self._heap[0][0] - self.clock <= _REL_EPS * max(1.0, abs(self._heap[0][0])):
            _, _, job = heapq.heappop(self._heap)
            self.kv_used -= job.kv
            done.append(job)
        return done

    def mark(self, t: float) -> None:
        """Open or close a busy span (called after each event time's changes)."""
        busy = bool(self._heap) and not self.paused
        if busy and self._busy_since is None:
            self._busy_since = t
        elif not busy and self._busy_since is not None:
            if t > self._busy_since:
                self.spans.append((self._busy_since, t))
            self._busy_since = None

    def close(self, t: float) -> None:
        if self._busy_since is not None and t > self._busy_since:
            self.spans.append((self._busy_since, t))
        self._busy_since = None


def take_first_fitting(replica: Replica, pools: dict[str, deque]) -> Job | None:
    """FCFS per pool: the head of the first pool (in the replica's priority) that fits."""
    for name in replica.pools:
        q = pools.get(name)
        if q and replica.fits(q[0]):
            return q.popleft()
    return None
