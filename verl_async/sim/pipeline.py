"""The discrete-event pipeline: Rollouter gate, replicas, MessageQueue, Trainer, sync.

Semantics (docs/architecture.md "Staleness", "Partial rollout"):

* The Rollouter submits groups while its count (groups submitted under the current
  parameter version) is below ``max_required_samples``, the queue has room
  (in-flight + queued < ``queue_capacity``) and, if set, in-flight <
  ``max_inflight_groups``. A dispatch batch (1 group, or the P-DSR batch) is
  submitted whole; it shrinks only to what the version budget, the workload or
  those limits can ever allow, else it waits for room.
* A group is complete when all n responses are; then it enters the FIFO queue.
* The Trainer takes ``required_samples`` groups per step; the step lasts
  ``train_a + train_b * tokens`` (tokens = sum of prompt_len + len per response).
  Staleness of a trained group = trainer version - the group's min_version.
* Every ``trigger_parameter_sync_step`` steps it syncs for ``sync_time``.
  partial_rollout on: the sync starts at once and every replica pauses during it
  (running responses keep their progress and continue after). Off: the Rollouter
  stops submitting, in-flight groups finish, then the sync runs. The trainer
  waits for the sync either way. After the sync the version goes up by one and
  the count restarts at in-flight + queued groups.
* The run ends when the last step ends: wall time = that instant (no final sync).

At one instant the order is: replica completions, then timers (train end, sync
end), then starts (sync, train step, submissions, admissions) until nothing moves.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence

from verl_async.sim.config import SimConfig
from verl_async.sim.dispatch import DISPATCHERS
from verl_async.sim.replica import Job, Replica, take_first_fitting
from verl_async.sim.result import GroupRecord, ResponseRecord, SimResult, StepRecord, summarize
from verl_async.sim.state import GroupState
from verl_async.sim.workload import GroupSpec


class SimError(RuntimeError):
    """The simulated pipeline cannot go on (e.g. a request that never fits a replica)."""


class Simulation:
    def __init__(self, cfg: SimConfig, workload: Sequence[GroupSpec]) -> None:
        self.cfg = cfg.validate()
        self.workload = list(workload)
        for i, g in enumerate(self.workload):
            if len(g.lengths) != cfg.n:
                raise ValueError(f"workload group {i} ({g.uid!r}) has {len(g.lengths)} responses, n = {cfg.n}")
            if max(g.lengths) > cfg.max_response_length:
                raise ValueError(f"workload group {i} ({g.uid!r}): response length {max(g.lengths)} "
                                 f"> max_response_length {cfg.max_response_length}")
        self.required = cfg.required_samples
        self.max_required = cfg.max_required
        self.capacity = cfg.queue_capacity or self.max_required
        possible = len(self.workload) // self.required
        self.num_steps = possible if cfg.num_steps is None else cfg.num_steps
        if not 1 <= self.num_steps <= possible:
            raise ValueError(f"num_steps {self.num_steps}: the workload has {len(self.workload)} groups, "
                             f"enough for 1..{possible} steps of {self.required} groups")
        self._check_kv_fits()
        self.dispatch = DISPATCHERS[cfg.dispatch](cfg)
        self.replicas = [Replica(i, cfg.speed, self.dispatch.max_num_seqs_for(i), cfg.kv_budget_tokens,
                                 self.dispatch.pools_for(i)) for i in range(cfg.replicas)]
        self.pools: dict[str, deque[Job]] = {}
        self.groups: dict[int, GroupState] = {}
        self.t = 0.0
        self.version = 0
        self.count = 0
        self.next_prompt = 0
        self.inflight: set[int] = set()
        self.queue: deque[int] = deque()
        self._timers: list = []
        self._tseq = itertools.count()
        self.training = False
        self.syncing = False
        self.sync_requested_at: float | None = None
        self.steps_done = 0
        self.steps_since_sync = 0
        self.trainer_idle_since = 0.0
        self.records: list[GroupRecord] = []
        self.steps: list[StepRecord] = []
        self.spans: list[dict] = []
        self.generated_tokens = 0

    # ---- helpers used by the dispatch policies ------------------------------------
    def make_job(self, gs: GroupState, response: int, kind: str, need: int, max_tokens: int,
                 prefix: int = 0, cap: int | None = None, prev: Job | None = None) -> Job:
        """A job; its KV reservation per ``kv_admission``: reserve = prompt + max_tokens
        (for a moved response: prompt + max_response_length), actual = prompt + the
        tokens it will really hold (prefix + need)."""
        if self.cfg.kv_admission == "reserve":
            kv = gs.spec.prompt_len + (self.cfg.max_response_length if kind == "moved" else max_tokens)
        else:
            kv = gs.spec.prompt_len + prefix + need
        return Job(gs.gid, response, int(need), int(kv), kind, prefix, cap, prev=prev)

    def push(self, pool: str, job: Job) -> None:
        self.pools.setdefault(pool, deque()).append(job)

    def finish_response(self, job: Job) -> None:
        gs = self.groups[job.group]
        chain = []
        j = job
        while j is not None:
            chain.append(j)
            j = j.prev
        chain.reverse()
        first = chain[0]
        length = gs.spec.lengths[job.response]
        moved = len(chain) > 1
        regenerated = sum(c.need for c in chain) - length
        gs.responses[job.response] = ResponseRecord(
            len=length,
            finish_reason="length" if length >= self.cfg.max_response_length else "stop",
            replica=job.replica, start=first.admitted, end=self.t,
            min_version=first.version, max_version=self.version,
            probe=first.kind == "probe", moved=moved, regenerated_tokens=regenerated,
            segments=[(c.replica, c.admitted, c.need) for c in chain])
        gs.remaining -= 1
        if gs.remaining == 0:
            self._group_complete(gs)

    # ---- the event loop -----------------------------------------------------------
    def run(self) -> SimResult:
        while self.steps_done < self.num_steps:
            self._schedule()
            for r in self.replicas:
                r.mark(self.t)
            t_next = min([self._timers[0][0]] if self._timers else [math.inf])
            t_next = min([t_next] + [r.next_event_time() for r in self.replicas])
            if math.isinf(t_next):
                raise SimError(f"stalled at t={self.t:.3f}: step {self.steps_done}/{self.num_steps}, "
                               f"{len(self.inflight)} groups in flight, {len(self.queue)} queued, "
                               f"pools {({k: len(v) for k, v in self.pools.items()})}")
            for r in self.replicas:
                r.advance(t_next)
            self.t = t_next
            for r in self.replicas:
                for job in r.pop_done():
                    self.generated_tokens += job.need
                    self.dispatch.on_done(self, job)
            while self._timers and self._timers[0][0] <= self.t:
                _, _, kind = heapq.heappop(self._timers)
                getattr(self, f"_on_{kind}")()
        for r in self.replicas:
            r.close(self.t)
        for gid in list(self.queue):  # completed but not trained groups are part of the run's length log too
            self._group_record(self.groups[gid])
        return summarize(self)

    def _timer(self, delay: float, kind: str) -> None:
        heapq.heappush(self._timers, (self.t + delay, next(self._tseq), kind))

    def _schedule(self) -> None:
        moved = True
        while moved:
            moved = self._maybe_start_sync() | self._maybe_train() | self._maybe_submit() | self._admit()

    def _maybe_start_sync(self) -> bool:
        if self.sync_requested_at is None or self.syncing:
            return False
        if not self.cfg.partial_rollout and self.inflight:
            return False
        self.syncing = True
        for r in self.replicas:
            r.paused = True
            r.mark(self.t)
        if self.t > self.sync_requested_at:
            self.spans.append(_span("trainer/rank0", "wait", self.sync_requested_at, self.t,
                                    self.version, {"reason": "drain"}))
        self.spans.append(_span("sync", "sync", self.t, self.t + self.cfg.sync_time, self.version + 1))
        self._timer(self.cfg.sync_time, "sync_end")
        return True

    def _on_sync_end(self) -> None:
        self.syncing = False
        self.sync_requested_at = None
        self.version += 1
        self.count = len(self.inflight) + len(self.queue)
        self.steps_since_sync = 0
        self.trainer_idle_since = self.t
        for r in self.replicas:
            r.paused = False

    def _maybe_train(self) -> bool:
        if self.training or self.syncing or self.sync_requested_at is not None:
            return False
        if len(self.queue) < self.required or self.steps_done >= self.num_steps:
            return False
        gids = [self.queue.popleft() for _ in range(self.required)]
        tokens = sum(sum(self.groups[g].spec.prompt_len + x for x in self.groups[g].spec.lengths)
                     for g in gids)
        duration = self.cfg.train_a + self.cfg.train_b * tokens
        staleness = []
        for g in gids:
            gs = self.groups.pop(g)
            rec = self._group_record(gs)
            rec.trained_step = self.steps_done
            rec.staleness = self.version - rec.min_version
            staleness.append(rec.staleness)
        if self.t > self.trainer_idle_since:
            self.spans.append(_span("trainer/rank0", "wait", self.trainer_idle_since, self.t, self.version))
        self.steps.append(StepRecord(self.steps_done, self.t, self.t + duration, tokens, self.version,
                                     staleness))
        self.spans.append(_span("trainer/rank0", "train", self.t, self.t + duration, self.version,
                                {"tokens": tokens, "groups": len(gids), "step": self.steps_done}))
        self.training = True
        self._timer(duration, "train_end")
        return True

    def _on_train_end(self) -> None:
        self.training = False
        self.steps_done += 1
        self.steps_since_sync += 1
        self.trainer_idle_since = self.t
        if self.steps_done < self.num_steps and self.steps_since_sync >= self.cfg.trigger_parameter_sync_step:
            self.sync_requested_at = self.t

    def _maybe_submit(self) -> bool:
        if self.syncing or self.sync_requested_at is not None:
            return False
        # a batch shrinks only to what this version, the workload or the limits ever allow;
        # otherwise it waits until the queue / in-flight room for all of it frees up
        limit = min(self.capacity, self.cfg.max_inflight_groups or self.capacity)
        want = min(self.dispatch.batch_size, self.max_required - self.count,
                   len(self.workload) - self.next_prompt, limit)
        if want <= 0:
            return False
        room = self.capacity - len(self.inflight) - len(self.queue)
        if self.cfg.max_inflight_groups is not None:
            room = min(room, self.cfg.max_inflight_groups - len(self.inflight))
        if room < want:
            return False
        batch = []
        for _ in range(want):
            gid = self.next_prompt
            spec = self.workload[gid]
            self.next_prompt += 1
            gs = GroupState(gid, spec, self.t, self.version, [None] * len(spec.lengths), len(spec.lengths))
            self.groups[gid] = gs
            self.inflight.add(gid)
            batch.append(gs)
        self.count += want
        self.dispatch.submit(self, batch)
        return True

    def _admit(self) -> bool:
        admitted = False
        while True:
            for r in sorted(self.replicas, key=lambda r: (r.active, r.index)):
                job = take_first_fitting(r, self.pools)
                if job is not None:
                    r.admit(job, self.t, self.version)
                    admitted = True
                    break
            else:
                return admitted

    def _group_complete(self, gs: GroupState) -> None:
        self.inflight.discard(gs.gid)
        self.queue.append(gs.gid)
        gs.finish_time = self.t

    def _group_record(self, gs: GroupState) -> GroupRecord:
        rec = GroupRecord(gs.gid, gs.spec.uid, gs.spec.prompt_len, gs.version_start,
                          max(r.max_version for r in gs.responses), gs.submit_time,
                          gs.finish_time, list(gs.responses))
        self.records.append(rec)
        return rec

    def _check_kv_fits(self) -> None:
        budget = self.cfg.kv_budget_tokens
        if budget is None:
            return
        for i, g in enumerate(self.workload):
            need = g.prompt_len + (self.cfg.max_response_length if self.cfg.kv_admission == "reserve"
                                   else max(g.lengths))
            if need > budget:
                raise ValueError(f"kv_budget_tokens {budget} < {need} tokens that workload group {i} "
                                 f"({g.uid!r}) needs alone ({self.cfg.kv_admission} admission)")


def _span(lane: str, kind: str, start: float, end: float, version: int, info: dict | None = None) -> dict:
    return {"lane": lane, "kind": kind, "start": start, "end": end, "version": version, "info": info or {}}


def simulate(cfg: SimConfig, workload: Sequence[GroupSpec]) -> SimResult:
    return Simulation(cfg, workload).run()
