"""P-DSR as a Rollouter scheduling policy: probe, rank, offload, cap, breaker, merge.

The planning math is pure and lives in :mod:`verl_async.rollout.pdsr`; this module
drives it with the Rollouter's real requests (``Rollouter.generate_one``), so engine
errors, retries, partial-rollout abort/continue across weight syncs and per-token
versions are handled exactly as for the plain policy.

Per batch of admitted prompts (docs/architecture.md "Long-tail scheduling (P-DSR)"):

1. probe: response 0 of every prompt, on any replica (least loaded by capacity);
2. when the batch is closed and all its probes are done, rank by probe length
   (``pdsr.plan_batch``): the top ``offload_ratio`` run their n-1 other responses on
   the heavy replicas, the rest on the fast replicas with ``max_tokens = cap``;
3. a fast response that stops at the cap (below the real maximum) trips the breaker
   and is moved to a heavy replica, where it CONTINUES from its prefix (its tokens,
   log-probs and versions are kept); ``restart`` regenerates it from scratch instead
   and counts the thrown-away tokens;
4. ``generate_group`` returns the probe and the rest as ONE list of n responses, so
   the Rollouter puts one complete group (it refuses any other count).

Batches: a prompt joins the open batch when its group starts. The batch closes when
it holds ``batch_size`` prompts, when the Rollouter stops admitting (staleness budget,
a sync, the end of the data; at the in-flight limit only when every group in flight
is waiting for this batch: ``on_admission_stalled``), or ``batch_timeout_s`` after it
opened (a safety net: the probe barrier must never wait for prompts that cannot come). The staleness budget is untouched: it still counts
groups when they start, one per prompt, whatever the phases inside.

Replicas: the LAST ``heavy_replicas`` indices are heavy, the others fast (the same
convention as the simulator, ``verl_async.sim``).

Versions: with ``partial_rollout=true`` any phase may be aborted at a sync and is
continued (per-token versions). With ``partial_rollout=false`` every REQUEST is
single-version, but a group's probe and rest (and a moved response's fast prefix and
heavy continuation) are separate requests and may fall on either side of a sync;
the per-token versions record it and staleness is measured by the oldest token as
always.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from verl_async.protocol import Response
from verl_async.rollout import pdsr
from verl_async.rollout.rollouter import PromptTask, Rollouter

CAP_MODES = ("l_cut", "probe")
TRUTHS = ("mean", "max")


def heavy_indices(num_replicas: int, heavy_replicas: int) -> tuple[int, ...]:
    """The heavy replicas: the last `heavy_replicas` indices (P-DSR needs >= 1 of each kind)."""
    if not 1 <= heavy_replicas < num_replicas:
        raise ValueError(
            f"async_training.long_tail.heavy_replicas must be in [1, replicas - 1] = [1, {num_replicas - 1}] "
            f"(P-DSR needs a fast and a heavy replica), got {heavy_replicas} with {num_replicas} replica(s)"
        )
    return tuple(range(num_replicas - heavy_replicas, num_replicas))


def replica_max_num_seqs(
    num_replicas: int, max_num_seqs: int, heavy_replicas: int, fast_max_num_seqs: Optional[int]
) -> list[int]:
    """Concurrent sequences per replica: heavy ones keep max_num_seqs, fast ones may take more."""
    heavy = set(heavy_indices(num_replicas, heavy_replicas))
    fast = int(fast_max_num_seqs) if fast_max_num_seqs else int(max_num_seqs)
    if fast < 1:
        raise ValueError(f"async_training.long_tail.fast_max_num_seqs must be >= 1 or null, got {fast_max_num_seqs}")
    return [int(max_num_seqs) if i in heavy else fast for i in range(num_replicas)]


@dataclass
class _Batch:
    """One P-DSR batch: members by position, their probes, then the plan."""

    members: list[PromptTask] = field(default_factory=list)
    probes: dict[int, Optional[Response]] = field(default_factory=dict)  # None: dropped
    closed: bool = False
    planned: bool = False
    go: dict[int, asyncio.Event] = field(default_factory=dict)  # position -> set when its rest may start
    plan: Optional[pdsr.BatchPlan] = None
    valid: list[int] = field(default_factory=list)  # positions in the plan (plan index -> batch position)
    finals: dict[int, Optional[list[int]]] = field(default_factory=dict)  # plan index -> final lengths
    timer: Optional[asyncio.TimerHandle] = None


class PDSRPolicy:
    """Probe-based long-tail scheduling; see the module docstring."""

    def __init__(
        self,
        rollouter: Rollouter,
        *,
        offload_ratio: float = 0.2,
        cap_factor: float = 1.5,
        cap_mode: str = "l_cut",
        heavy_replicas: int = 1,
        restart: bool = False,
        batch_size: int = 8,
        batch_timeout_s: float = 5.0,
        truth: str = "mean",
    ) -> None:
        key = "async_training.long_tail"
        if not 0.0 <= offload_ratio <= 1.0:
            raise ValueError(f"{key}.offload_ratio must be in [0, 1], got {offload_ratio}")
        if not cap_factor > 0:
            raise ValueError(f"{key}.cap_factor must be > 0, got {cap_factor}")
        if cap_mode not in CAP_MODES:
            raise ValueError(f"{key}.cap_mode must be one of {CAP_MODES}, got {cap_mode!r}")
        if int(batch_size) < 1:
            raise ValueError(f"{key}.batch_size must be >= 1, got {batch_size}")
        if not batch_timeout_s > 0:
            raise ValueError(f"{key}.batch_timeout_s must be > 0, got {batch_timeout_s}")
        if truth not in TRUTHS:
            raise ValueError(f"P-DSR precision truth must be one of {TRUTHS}, got {truth!r}")
        self.rollouter = rollouter
        self.offload_ratio = float(offload_ratio)
        self.cap_factor = float(cap_factor)
        self.cap_mode = cap_mode
        self.restart = bool(restart)
        self.batch_size = int(batch_size)
        self.batch_timeout_s = float(batch_timeout_s)
        self.truth = truth
        self.heavy = heavy_indices(len(rollouter.engines), int(heavy_replicas))
        self.fast = tuple(i for i in range(len(rollouter.engines)) if i not in self.heavy)
        self.stats = pdsr.PDSRStats()
        self.moved_tokens = 0  # tokens a moved response kept from its fast part (continue) or threw away (restart)
        self.last_l_cut: Optional[int] = None
        self.last_fast_cap: Optional[int] = None
        self._open: Optional[_Batch] = None

    @property
    def max_response_length(self) -> int:
        return int(self.rollouter.sampling.max_tokens)

    # ------------------------------------------------------------------ batching
    def _join(self, item: PromptTask) -> tuple[_Batch, int]:
        batch = self._open
        if batch is None:
            batch = self._open = _Batch()
            batch.timer = asyncio.get_running_loop().call_later(self.batch_timeout_s, self._close, batch)
        batch.members.append(item)
        batch.go[len(batch.members) - 1] = asyncio.Event()
        if len(batch.members) >= self.batch_size:
            self._close(batch)
        return batch, len(batch.members) - 1

    def on_admission_stalled(self, reason: str) -> None:
        """The Rollouter admits no group for now (sync | budget | inflight | end).

        At a sync, the budget's end or the data's end no prompt comes for a while: the open
        batch is planned now. At the in-flight limit a slot frees when some group finishes,
        so the batch keeps waiting unless every group in flight is one of its own members
        (they wait for the plan and would never free a slot).
        """
        # call_soon runs after the first step of every group task created before this call
        # (they join the open batch there), so groups started just before the stall are in it.
        asyncio.get_running_loop().call_soon(self._on_stall, reason)

    def _on_stall(self, reason: str) -> None:
        batch = self._open
        if batch is None:
            return
        if reason == "inflight" and self.rollouter.inflight_groups > len(batch.members):
            return
        self._close(batch)

    def _close(self, batch: _Batch) -> None:
        if batch.closed:
            return
        batch.closed = True
        if batch.timer is not None:
            batch.timer.cancel()
        if self._open is batch:
            self._open = None
        self._maybe_plan(batch)

    def _probe_done(self, batch: _Batch, pos: int, probe: Optional[Response]) -> None:
        batch.probes[pos] = probe
        self._maybe_plan(batch)

    def _maybe_plan(self, batch: _Batch) -> None:
        if not batch.closed or batch.planned or len(batch.probes) < len(batch.members):
            return
        batch.valid = [p for p in range(len(batch.members)) if batch.probes[p] is not None]
        lengths = [len(batch.probes[p]) for p in batch.valid]  # type: ignore[arg-type]
        plan = pdsr.plan_batch(lengths, self.offload_ratio, self.cap_factor, self.max_response_length, self.cap_mode)
        self.stats.record_plan(plan, self.rollouter.n)
        if plan.fast:
            self.last_l_cut, self.last_fast_cap = plan.l_cut, plan.fast_cap
        batch.plan = plan
        batch.planned = True
        # wake the groups longest probe first, so their rest requests reach the engines in rank order
        for index in plan.order:
            batch.go[batch.valid[index]].set()
        for pos, event in batch.go.items():
            event.set()  # dropped probes (no rest to run)

    def _group_done(self, batch: _Batch, index: int, lengths: Optional[list[int]]) -> None:
        batch.finals[index] = lengths
        if len(batch.finals) == len(batch.valid) and all(v is not None for v in batch.finals.values()):
            assert batch.plan is not None
            self.stats.record_precision(batch.plan, [batch.finals[i] for i in range(len(batch.valid))], self.truth)

    # ------------------------------------------------------------------ one group
    async def generate_group(self, item: PromptTask) -> Optional[list[Response]]:
        ro = self.rollouter
        batch, pos = self._join(item)
        probe: Optional[Response] = None
        reported = False
        try:
            probe = await ro.generate_one(item, 0)
            if probe is not None:
                probe.sched["probe"] = True
            self._probe_done(batch, pos, probe)
            reported = True
        finally:
            if not reported:  # cancelled: the batch must not wait for this probe
                self._probe_done(batch, pos, None)
        await batch.go[pos].wait()
        if probe is None:
            return None
        assert batch.plan is not None
        index = batch.valid.index(pos)
        cap = batch.plan.cap_for(index)
        broken = [False]
        rests = await asyncio.gather(*(self._rest(item, i, cap, broken) for i in range(1, ro.n)))
        if any(r is None for r in rests):
            self._group_done(batch, index, None)
            return None
        responses = [probe, *rests]
        self._group_done(batch, index, [len(r) for r in responses])  # type: ignore[arg-type]
        return responses  # type: ignore[return-value]

    async def _rest(self, item: PromptTask, i: int, cap: Optional[int], broken: list[bool]) -> Optional[Response]:
        """Response i (> 0): heavy when cap is None; else fast under the cap, moved to heavy at the breaker."""
        ro = self.rollouter
        if cap is None:
            return await ro.generate_one(item, i, engines=self.heavy)
        first = await ro.generate_one(item, i, engines=self.fast, max_tokens=cap)
        if first is None or not pdsr.trips_breaker(first.finish_reason, len(first), cap, self.max_response_length):
            return first
        regenerated = len(first) if self.restart else 0
        self.stats.record_breaker(regenerated, first_in_group=not broken[0])
        broken[0] = True
        self.moved_tokens += len(first)
        moved = await ro.generate_one(item, i, engines=self.heavy, prefix=None if self.restart else first)
        if moved is not None:
            moved.sched.update(moved=True, regenerated_tokens=regenerated)
        return moved

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        """pdsr/* counters (PDSRStats names) plus the last batch's cut and cap."""
        out = {k: float(v) for k, v in self.stats.metrics().items() if v is not None}
        out["pdsr/moved_prefix_tokens"] = float(self.moved_tokens)
        if self.last_fast_cap is not None:
            out["pdsr/l_cut"] = float(self.last_l_cut or 0)
            out["pdsr/fast_cap"] = float(self.last_fast_cap)
        return out


def scheduling_from_config(
    long_tail: Any, num_replicas: int, max_num_seqs: int, required_samples: int
) -> tuple[str, dict[str, Any], list[int]]:
    """(policy name, its kwargs, max_num_seqs per replica) from `async_training.long_tail`.

    Off (or missing): "plain", every replica at max_num_seqs. On: "pdsr" with batch_size
    defaulting to required_samples (one trainer step's worth of prompts).
    """
    get = long_tail.get if long_tail is not None else (lambda key, default=None: default)
    if not bool(get("enable", False)):
        return "plain", {}, [int(max_num_seqs)] * num_replicas
    heavy = int(get("heavy_replicas", 1))
    capacities = replica_max_num_seqs(num_replicas, max_num_seqs, heavy, get("fast_max_num_seqs"))
    kwargs = {
        "offload_ratio": float(get("offload_ratio", 0.2)),
        "cap_factor": float(get("cap_factor", 1.5)),
        "cap_mode": str(get("cap_mode", "l_cut")),
        "heavy_replicas": heavy,
        "restart": bool(get("restart", False)),
        "batch_size": int(get("batch_size") or required_samples),
        "batch_timeout_s": float(get("batch_timeout_s", 5.0)),
    }
    return "pdsr", kwargs, capacities


def max_inflight_groups(capacities: list[int], n: int, scheduling: str, kwargs: dict[str, Any]) -> int:
    """Groups the Rollouter may hold in flight: enough to fill every replica's slots with n each;
    P-DSR adds one batch, so the next batch probes while the last one runs its rest (a group
    in its probe phase holds one request, not n)."""
    base = max(1, sum(capacities) // max(1, n))
    return base + int(kwargs.get("batch_size", 0)) if scheduling == "pdsr" else base


def scheduling_metrics(rollouter: Rollouter, wall_s: float) -> dict[str, float]:
    """What a scheduling policy is judged by: replica busy ratios, group latency, policy counters.

    rollout/replica{i}/busy_ratio: share of `wall_s` with >= 1 request on replica i;
    rollout/group_latency_p50/p95/p99: submit -> finish seconds of the last 10k groups;
    plus the policy's own metrics() (P-DSR: pdsr/*).
    """
    out: dict[str, float] = {}
    wall = max(float(wall_s), 1e-9)
    busy = rollouter.replica_busy_seconds()
    for i, b in enumerate(busy):
        out[f"rollout/replica{i}/busy_ratio"] = min(1.0, b / wall)
    out["rollout/replica_busy_ratio_min"] = min(busy) / wall if busy else 0.0
    lat = list(rollouter.group_latencies)
    if lat:
        for q, v in zip((50, 95, 99), np.percentile(lat, [50, 95, 99])):
            out[f"rollout/group_latency_p{q}"] = float(v)
    policy_metrics = getattr(rollouter.policy, "metrics", None)
    if policy_metrics is not None:
        out.update(policy_metrics())
    return out
