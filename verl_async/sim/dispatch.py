"""Dispatch policies: how a submitted batch of groups becomes replica jobs.

``plain``: all n responses of a group go to the shared pool served by every
replica. ``pdsr``: probe -> rank -> offload/cap -> breaker (docs/architecture.md "Long-tail
scheduling"), using the pure planner in :mod:`verl_async.rollout.pdsr`.
Chosen by name from :data:`DISPATCHERS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from verl_async.rollout import pdsr
from verl_async.sim.config import SimConfig
from verl_async.sim.replica import Job
from verl_async.sim.state import DispatchHost, GroupState


class Dispatcher(Protocol):
    batch_size: int

    def pools_for(self, replica: int) -> tuple[str, ...]: ...
    def max_num_seqs_for(self, replica: int) -> int: ...
    def submit(self, sim: DispatchHost, groups: list[GroupState]) -> None: ...
    def on_done(self, sim: DispatchHost, job: Job) -> None: ...
    def metrics(self) -> dict: ...


class PlainDispatch:
    """Every response of a group to the shared pool, FCFS, least-loaded replica first."""

    batch_size = 1

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg

    def pools_for(self, replica: int) -> tuple[str, ...]:
        return ("all",)

    def max_num_seqs_for(self, replica: int) -> int:
        return self.cfg.max_num_seqs

    def submit(self, sim: DispatchHost, groups: list[GroupState]) -> None:
        for gs in groups:
            for r, length in enumerate(gs.spec.lengths):
                sim.push("all", sim.make_job(gs, r, "plain", length, self.cfg.max_response_length))

    def on_done(self, sim: DispatchHost, job: Job) -> None:
        sim.finish_response(job)

    def metrics(self) -> dict:
        return {}


@dataclass
class _Batch:
    groups: list[GroupState]
    probes_left: int


class PDSRDispatch:
    """Probe one response per prompt, rank, offload the top to heavy replicas, cap the rest.

    Pools: ``probe`` (fast replicas first; heavy ones after their heavy work when
    ``probe_on_heavy``), ``fast`` (rest of fast prompts, max_tokens = the cap) and
    ``heavy`` (rest of offloaded prompts, then moved responses, FCFS; with the
    ``fast_steal_heavy`` variant fast replicas take it last, when idle). Rests enter
    their pool in rank order (longest probe first). The group completes, and goes
    to the queue, only when probe + all rests are done: it is never split.
    """

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.p = cfg.pdsr
        self.heavy = set(range(cfg.replicas - self.p.heavy_replicas, cfg.replicas))
        self.batch_size = self.p.batch_size or cfg.required_samples
        self.stats = pdsr.PDSRStats()
        self._batch_of: dict[int, _Batch] = {}
        self._broken: set[int] = set()     # groups with a moved response

    def pools_for(self, replica: int) -> tuple[str, ...]:
        if replica in self.heavy:
            return ("heavy", "probe") if self.p.probe_on_heavy else ("heavy",)
        return ("probe", "fast", "heavy") if self.p.fast_steal_heavy else ("probe", "fast")

    def max_num_seqs_for(self, replica: int) -> int:
        if replica in self.heavy:
            return self.cfg.max_num_seqs
        return self.p.fast_max_num_seqs or self.cfg.max_num_seqs

    def submit(self, sim: DispatchHost, groups: list[GroupState]) -> None:
        batch = _Batch(list(groups), len(groups))
        for gs in groups:
            self._batch_of[gs.gid] = batch
            sim.push("probe", sim.make_job(gs, gs.spec.probe, "probe", gs.spec.probe_len,
                                           self.cfg.max_response_length))

    def on_done(self, sim: DispatchHost, job: Job) -> None:
        gs = sim.groups[job.group]
        true_len = gs.spec.lengths[job.response]
        if job.kind == "fast" and true_len > job.cap:
            out = pdsr.breaker_outcome(true_len, job.cap, self.p.restart)
            self.stats.record_breaker(out.regenerated_tokens, job.group not in self._broken)
            self._broken.add(job.group)
            sim.push("heavy", sim.make_job(
                gs, job.response, "moved", out.heavy_tokens, self.cfg.max_response_length,
                prefix=0 if self.p.restart else out.fast_tokens, prev=job))
            return
        sim.finish_response(job)
        if job.kind == "probe":
            batch = self._batch_of.pop(job.group)
            batch.probes_left -= 1
            if batch.probes_left == 0:
                self._plan(sim, batch)

    def _plan(self, sim: DispatchHost, batch: _Batch) -> None:
        specs = [gs.spec for gs in batch.groups]
        plan = pdsr.plan_batch([s.probe_len for s in specs], self.p.offload_ratio,
                               self.p.cap_factor, self.cfg.max_response_length, self.p.cap_mode)
        self.stats.record_plan(plan, self.cfg.n)
        self.stats.record_precision(plan, [s.lengths for s in specs], self.p.truth)
        for pos in plan.order:
            gs, cap = batch.groups[pos], plan.cap_for(pos)
            for r, length in enumerate(gs.spec.lengths):
                if r == gs.spec.probe:
                    continue
                if cap is None:
                    sim.push("heavy", sim.make_job(gs, r, "heavy", length, self.cfg.max_response_length))
                else:
                    sim.push("fast", sim.make_job(gs, r, "fast", min(length, cap), cap, cap=cap))

    def metrics(self) -> dict:
        return self.stats.metrics()


DISPATCHERS = {"plain": PlainDispatch, "pdsr": PDSRDispatch}
