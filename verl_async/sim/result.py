"""Simulation records and the summary metrics.

Ratios are of the wall time (start of the run to the end of the last train step):

* replica busy = time it had >= 1 running sequence and was not paused for a sync;
  idle ratio = 1 - busy / wall (sync pauses count as idle); mean_batch = running
  sequences averaged over its busy time;
* rollout busy ratio = mean replica busy ratio;
* trainer idle ratio = 1 - train time / wall (waiting for data, draining and
  syncing all count as idle);
* pipeline efficiency = max(mean replica busy, train time) / wall: 1.0 means the
  slower side never waited;
* group latency = finish - submit of every completed group (p50/p95/p99);
* staleness = trainer version - group min_version of every trained group.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from verl_async.sim.config import SimConfig
from verl_async.sim.replica import Replica


@dataclass
class ResponseRecord:
    len: int
    finish_reason: str
    replica: int
    start: float
    end: float
    min_version: int
    max_version: int
    probe: bool
    moved: bool
    regenerated_tokens: int
    segments: list[tuple[int, float, int]] = field(default_factory=list)  # (replica, start, tokens)

    def to_log(self) -> dict:
        d = asdict(self)
        d.pop("segments")
        return d


@dataclass
class GroupRecord:
    gid: int
    uid: str
    prompt_len: int
    param_version_start: int
    param_version_end: int
    submit_time: float
    finish_time: float
    responses: list[ResponseRecord]
    trained_step: int | None = None
    staleness: int | None = None

    @property
    def min_version(self) -> int:
        return min(r.min_version for r in self.responses)

    def to_log(self) -> dict:
        """One lengths.jsonl line (LOG_FORMATS.md)."""
        return {"uid": self.uid, "index": self.gid, "epoch": 0, "prompt_len": self.prompt_len,
                "param_version_start": self.param_version_start,
                "param_version_end": self.param_version_end,
                "submit_time": self.submit_time, "finish_time": self.finish_time,
                "responses": [r.to_log() for r in self.responses]}


@dataclass
class StepRecord:
    step: int
    start: float
    end: float
    tokens: int
    version: int
    staleness: list[int]


@dataclass
class SimResult:
    summary: dict
    groups: list[GroupRecord]
    steps: list[StepRecord]
    spans: list[dict]

    def timeline(self) -> list[dict]:
        return sorted(self.spans, key=lambda s: (s["start"], s["lane"]))

    def length_log(self) -> list[dict]:
        return [g.to_log() for g in sorted(self.groups, key=lambda g: g.finish_time)]


def percentiles(values, qs=(50, 95, 99)) -> dict[str, float | None]:
    if len(values) == 0:
        return {f"p{q}": None for q in qs}
    arr = np.asarray(values, dtype=float)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


class RunView(Protocol):
    """What `summarize` reads of a finished Simulation (pipeline.py), which calls it: a Protocol, so that this
    module need not import the simulation."""

    cfg: SimConfig
    t: float
    max_required: int
    steps_done: int
    generated_tokens: int
    replicas: list[Replica]
    records: list[GroupRecord]  # every completed group, trained or not
    steps: list[StepRecord]
    spans: list[dict]
    dispatch: Any  # sim/dispatch.py's Dispatcher: metrics(), and `heavy` replicas with P-DSR


def summarize(sim: RunView) -> SimResult:
    cfg = sim.cfg
    wall = sim.t
    groups = sorted(sim.records, key=lambda g: g.gid)
    trained = [g for g in groups if g.trained_step is not None]
    spans = list(sim.spans)
    replicas = []
    heavy = getattr(sim.dispatch, "heavy", set())
    for r in sim.replicas:
        role = ("heavy" if r.index in heavy else "fast") if cfg.dispatch == "pdsr" else "any"
        replicas.append({"index": r.index, "role": role, "busy": r.busy_time,
                         "busy_ratio": r.busy_time / wall if wall else 0.0,
                         "idle_ratio": 1.0 - r.busy_time / wall if wall else 0.0,
                         "mean_batch": r.seq_time / r.busy_time if r.busy_time else 0.0})
        spans += [{"lane": f"rollout/replica{r.index}", "kind": "generate", "start": a, "end": b,
                   "version": None, "info": {}} for a, b in r.spans]
    train_busy = sum(s.end - s.start for s in sim.steps)
    sync_total = sum(s["end"] - s["start"] for s in sim.spans if s["kind"] == "sync")
    drain = sum(s["end"] - s["start"] for s in sim.spans if s["info"].get("reason") == "drain")
    gen_busy = float(np.mean([r.busy_time for r in sim.replicas]))
    stale = [g.staleness for g in trained]
    latency = [g.finish_time - g.submit_time for g in groups]
    trained_tokens = sum(s.tokens for s in sim.steps)
    summary = {
        "dispatch": cfg.dispatch,
        "staleness_threshold": cfg.staleness_threshold,
        "trigger_parameter_sync_step": cfg.trigger_parameter_sync_step,
        "partial_rollout": cfg.partial_rollout,
        "max_required_samples": sim.max_required,
        "wall_time": wall,
        "steps": sim.steps_done,
        "groups_trained": len(trained),
        "groups_completed": len(groups),
        "generated_tokens": sim.generated_tokens,
        "trained_tokens": trained_tokens,
        "trained_tokens_per_s": trained_tokens / wall if wall else 0.0,
        "replicas": replicas,
        "rollout_busy_ratio": gen_busy / wall if wall else 0.0,
        "trainer_busy": train_busy,
        "trainer_idle_ratio": 1.0 - train_busy / wall if wall else 0.0,
        "sync_total": sync_total,
        "drain_wait_total": drain,
        "pipeline_efficiency": max(gen_busy, train_busy) / wall if wall else 0.0,
        "group_latency": percentiles(latency),
        "staleness": {"mean": float(np.mean(stale)) if stale else 0.0,
                      "max": int(max(stale)) if stale else 0,
                      "hist": {str(k): v for k, v in sorted(Counter(stale).items())}},
        "regenerated_tokens": sum(r.regenerated_tokens for g in groups for r in g.responses),
        "moved_responses": sum(r.moved for g in groups for r in g.responses),
    }
    summary.update(sim.dispatch.metrics())
    return SimResult(summary, groups, list(sim.steps), spans)
