"""P-DSR scheduling policy in the Rollouter, model-free (FakeEngine, scripted lengths).

The scheduling logic is what is tested here: which replica runs what, the breaker,
continuation vs restart, group completeness, staleness accounting, metrics on a
constructed case. tests/test_pdsr_native.py repeats the essentials on real Ray replicas
of the native engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes import FakeEngine
from tests.test_rollouter import ListSource, Sink
from verl_async.config import schema_rules as S
from verl_async.queue import MessageQueue
from verl_async.rollout import pdsr_policy
from verl_async.rollout.engine import GenerateResult, SamplingParams
from verl_async.rollout.pdsr_policy import (
    PDSRPolicy,
    heavy_indices,
    replica_max_num_seqs,
    scheduling_from_config,
    scheduling_metrics,
)
from verl_async.rollout.rollouter import Rollouter
from verl_async.rollout.scripted import TargetLengthEngine, parse_request_id
from verl_async.staleness import StalenessBudget, max_required_samples


class RecordingBudget(StalenessBudget):
    """The staleness budget, checked at every call: never over the limit, one start per group."""

    def __init__(self, limit: int):
        super().__init__(limit)
        self.starts = 0
        self.syncs: list[int] = []

    def on_start(self) -> None:
        assert self.can_start(), "a group started past the staleness budget"
        self.starts += 1
        super().on_start()

    def on_sync(self, outstanding: int) -> None:
        self.syncs.append(outstanding)
        super().on_sync(outstanding)


async def score(item, responses):
    return [(1.0, {}) for _ in responses]


def make(
    num_prompts,
    *,
    n=3,
    limit=64,
    engines=None,
    scheduling=PDSRPolicy,
    max_tokens=100,
    partial=True,
    log=None,
    targets=None,
    delay=0.0005,
    seed=0,
    max_inflight=64,
    **kwargs,
):
    queue = MessageQueue(capacity=max(limit, num_prompts), group_size=n)
    if engines is None:
        engines = [FakeEngine(seed=seed + k, max_len=max_tokens, token_delay=delay) for k in range(2)]
    if targets is not None:
        engines = [TargetLengthEngine(e, lambda uid, i: targets[uid][i]) for e in engines]
    ro = Rollouter(
        engines=engines,
        prompts=ListSource(num_prompts),
        scorer=score,
        sink=Sink(queue),
        n=n,
        sampling=SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=targets is not None),
        budget=RecordingBudget(limit),
        partial_rollout=partial,
        max_inflight_groups=max_inflight,
        lengths_log=log,
        scheduling=scheduling,
        scheduling_kwargs=kwargs if scheduling is PDSRPolicy else {},
    )
    return ro, queue


async def produce(ro, queue):
    await ro.run()
    await queue.close()
    out = []
    while True:
        batch = await queue.get_batch(1, timeout=1)
        if not batch:
            return out
        out += batch


# probe (response 0) lengths 10, 20, 5, 8, 40 -> P4 offloaded (k = round(0.2 * 5) = 1),
# L_cut = 20, cap = 30; rests over 30 trip the breaker: P0 r2, P1 r2, P3 r1 and r2.
TARGETS = {
    "e0-i0": [10, 12, 35],
    "e0-i1": [20, 25, 45],
    "e0-i2": [5, 5, 5],
    "e0-i3": [8, 31, 32],
    "e0-i4": [40, 50, 60],
}


def test_forced_row_lengths_hold_under_the_cap():
    """A benchmark row's `extra_info.target_lengths` (scripts/bench_async.py, ignore_eos) caps each response under
    P-DSR too: the fast pass's cap must not replace the target (it did: short responses ran on to the cap, and the
    moved ones on to their target after it, doubling the mean length on GPU)."""
    source = ListSource(5)
    for item in source.items:
        item.extra_info = {"target_lengths": TARGETS[item.uid]}
    queue = MessageQueue(capacity=64, group_size=3)
    engines = [FakeEngine(seed=k, max_len=100, token_delay=0.0005) for k in range(2)]
    ro = Rollouter(engines=engines, prompts=source, scorer=score, sink=Sink(queue), n=3,
                   sampling=SamplingParams(max_tokens=100, seed=0, ignore_eos=True), budget=RecordingBudget(64),
                   partial_rollout=True, max_inflight_groups=64, scheduling=PDSRPolicy,
                   scheduling_kwargs={"batch_size": 5, "batch_timeout_s": 30})
    groups = {g.uid: g for g in asyncio.run(asyncio.wait_for(produce(ro, queue), 30))}
    assert {uid: [len(r) for r in g.responses] for uid, g in groups.items()} == TARGETS
    assert sum(r.sched.get("moved", False) for g in groups.values() for r in g.responses) == 4  # as constructed


def run_constructed(tmp_path, restart):
    log = tmp_path / "rollout" / "lengths.jsonl"
    ro, q = make(5, targets=TARGETS, log=str(log), batch_size=5, batch_timeout_s=30, restart=restart)
    groups = {g.uid: g for g in asyncio.run(asyncio.wait_for(produce(ro, q), 30))}
    return ro, groups, [json.loads(line) for line in open(log)]


@pytest.mark.parametrize("restart", [False, True])
def test_constructed_case_offload_breaker_and_metrics(tmp_path, restart):
    ro, groups, log = run_constructed(tmp_path, restart)
    fast, heavy = 0, 1
    assert sorted(groups) == sorted(TARGETS)
    for uid, g in groups.items():
        assert [len(r) for r in g.responses] == TARGETS[uid], uid  # exact scripted lengths, n responses
        assert [r.sched.get("probe", False) for r in g.responses] == [True, False, False]
        assert all(r.finish_reason == "stop" for r in g.responses)
        for r in g.responses:
            assert r.token_ids == [k % 7 + 1 for k in range(len(r))]  # nothing lost or duplicated
    moved = {(uid, i) for uid, g in groups.items() for i, r in enumerate(g.responses) if r.sched.get("moved")}
    assert moved == {("e0-i0", 2), ("e0-i1", 2), ("e0-i3", 1), ("e0-i3", 2)}
    for uid, g in groups.items():
        for i, r in enumerate(g.responses[1:], start=1):
            want = heavy if uid == "e0-i4" or (uid, i) in moved else fast
            assert r.replica == want, (uid, i)
            assert r.sched.get("regenerated_tokens", 0) == (30 if restart and (uid, i) in moved else 0)
    m = ro.policy.metrics()
    assert m["pdsr/offload_count"] == 1 and m["pdsr/batches"] == 1
    assert m["pdsr/l_cut"] == 20 and m["pdsr/fast_cap"] == 30
    assert m["pdsr/fast_responses"] == 8 and m["pdsr/breaker_count"] == 4
    assert m["pdsr/breaker_rate"] == pytest.approx(4 / 8)
    assert m["pdsr/breaker_prompt_rate"] == pytest.approx(3 / 4)
    assert m["pdsr/topk_precision"] == 1.0
    assert m["pdsr/regenerated_tokens"] == (4 * 30 if restart else 0)
    # the log says the same: probe/moved/regenerated per response
    by_uid = {rec["uid"]: rec for rec in log}
    assert [r["probe"] for r in by_uid["e0-i3"]["responses"]] == [True, False, False]
    assert [r["moved"] for r in by_uid["e0-i3"]["responses"]] == [False, True, True]
    assert sum(r["regenerated_tokens"] for rec in log for r in rec["responses"]) == (120 if restart else 0)
    # generated tokens: continuation adds nothing; restart regenerates each moved prefix once
    assert ro.counters.generated_tokens == sum(map(sum, TARGETS.values())) + (120 if restart else 0)


def test_continued_response_keeps_prefix_and_versions(tmp_path):
    """A moved response continues after a sync: its fast prefix keeps version 0, the rest is version 1."""

    class Gate(FakeEngine):
        """Holds continuations until released (an abort returns them unchanged), so a sync lands in between."""

        def __init__(self, **kw):
            super().__init__(**kw)
            self.release = asyncio.Event()
            self.aborted = asyncio.Event()
            self.waiting = 0

        async def generate(self, request):
            if request.prefix_token_ids and not self.release.is_set():
                self.waiting += 1
                self.aborted.clear()
                waits = [asyncio.ensure_future(e.wait()) for e in (self.release, self.aborted)]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
                if not self.release.is_set():
                    return GenerateResult(request.request_id, list(request.prefix_token_ids),
                                          list(request.prefix_log_probs), list(request.prefix_versions), "abort")
            return await super().generate(request)

        async def abort(self, request_ids=None):
            self.aborted.set()
            await super().abort(request_ids)

    targets = {"e0-i0": [4, 9], "e0-i1": [2, 2]}  # probes 4, 2 -> offload 0 of 2; L_cut 4, cap 6: r1 of P0 moves

    async def go():
        heavy = Gate(max_len=50, token_delay=0.0005)
        ro, q = make(2, n=2, engines=[FakeEngine(max_len=50, token_delay=0.0005), heavy], targets=targets,
                     batch_size=2, offload_ratio=0.0)
        task = asyncio.create_task(ro.run())
        while heavy.waiting == 0:
            await asyncio.sleep(0.005)
        await ro.pause_for_sync()
        await ro.load_weights([("w", torch.ones(1))], 1)
        await ro.resume_after_sync(1)
        heavy.release.set()
        await asyncio.wait_for(task, 10)
        return {g.uid: g for g in await q.get_batch(2, timeout=5)}

    groups = asyncio.run(asyncio.wait_for(go(), 20))
    r = groups["e0-i0"].responses[1]
    assert r.sched["moved"] and r.replica == 1 and len(r) == 9
    assert r.versions == [0] * 6 + [1] * 3  # the capped prefix kept its version
    assert r.log_probs == [-0.5] * 9 and r.token_ids == [k % 7 + 1 for k in range(9)]
    assert groups["e0-i0"].min_version == 0 and groups["e0-i0"].max_version == 1


class ShortPolicy:
    """A broken policy: one response short."""

    def __init__(self, rollouter):
        self.rollouter = rollouter

    async def generate_group(self, item):
        ro = self.rollouter
        return [await ro.generate_one(item, i) for i in range(ro.n - 1)]


def test_policy_returning_a_partial_group_fails_loudly():
    ro, q = make(2, scheduling=ShortPolicy)
    with pytest.raises(RuntimeError, match="returned 2 responses .* expected 3"):
        asyncio.run(asyncio.wait_for(produce(ro, q), 10))
    assert q.size() == 0  # nothing partial reached the queue


def test_partial_batch_is_planned_when_the_budget_stops_admission():
    """Budget 4 < batch_size 8, a long timeout: the stall flush plans the 4 admitted groups."""

    async def go():
        ro, q = make(10, limit=4, batch_size=8, batch_timeout_s=60, max_tokens=12)
        task = asyncio.create_task(ro.run())
        first = await q.get_batch(4, timeout=5)  # would time out if the batch waited for 8
        assert ro.budget.starts == 4 and ro.counters.started_groups == 4
        assert ro.policy.stats.batches == 1 and ro.policy.stats.prompts == 4
        await ro.pause_for_sync()
        await ro.load_weights([], 1)
        await ro.resume_after_sync(1)
        second = await q.get_batch(4, timeout=5)
        await ro.pause_for_sync()
        await ro.load_weights([], 2)
        await ro.resume_after_sync(2)
        await asyncio.wait_for(task, 10)
        rest = await q.get_batch(2, timeout=5)
        return ro, first + second + rest

    ro, groups = asyncio.run(asyncio.wait_for(go(), 30))
    assert sorted(g.uid for g in groups) == sorted(f"e0-i{i}" for i in range(10))
    assert ro.budget.starts == 10 and ro.budget.syncs == [0, 0]  # the budget counts groups, not requests
    assert all(len(g.responses) == 3 for g in groups)


@pytest.mark.parametrize("max_inflight, batch_size, batches", [(4, 8, 3), (6, 3, 4)])
def test_in_flight_limit_plans_full_batches_and_never_deadlocks(max_inflight, batch_size, batches):
    """At the in-flight limit a batch waits for slots that other groups free, and is planned at
    once when all groups in flight are its own (they could never free one): 10-12 prompts,
    a 60 s timeout that must not be needed."""
    count = 12 if batch_size == 3 else 10
    ro, q = make(count, max_inflight=max_inflight, batch_size=batch_size, batch_timeout_s=60, max_tokens=12)
    t0 = time.monotonic()
    groups = asyncio.run(asyncio.wait_for(produce(ro, q), 30))
    assert time.monotonic() - t0 < 20 and len(groups) == count
    # (4, 8): 4 + 4 + 2 prompts (planned when all in flight are members); (6, 3): four full batches
    assert ro.policy.stats.batches == batches and ro.policy.stats.prompts == count


@settings(max_examples=12, deadline=None)
@given(
    required=st.integers(1, 3),
    trigger=st.integers(1, 2),
    threshold=st.sampled_from([0.0, 0.5, 1.0]),
    partial=st.booleans(),
    n=st.integers(1, 4),
    batch_size=st.integers(1, 5),
    restart=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_groups_complete_and_staleness_accounting_unchanged(required, trigger, threshold, partial, n, batch_size, restart, seed):
    """The plain policy's pipeline invariants hold under P-DSR with syncs, partial rollout, random lengths."""
    limit = max_required_samples(required, trigger, threshold)
    ro, q = make(9, n=n, limit=limit, partial=partial, seed=seed, max_tokens=10, batch_size=batch_size,
                 restart=restart, batch_timeout_s=0.05, offload_ratio=0.3, cap_factor=1.0)

    async def trainer():
        version, step, out = 0, 0, []
        rtask = asyncio.create_task(ro.run())
        rtask.add_done_callback(lambda t: asyncio.ensure_future(q.close()))
        while True:
            batch = await q.get_batch(required, timeout=20)
            if not batch:
                break
            out += [(g, version) for g in batch]
            step += 1
            if step % trigger == 0:
                await ro.pause_for_sync()
                await ro.load_weights([("w", torch.ones(1))], version + 1)
                version += 1
                await ro.resume_after_sync(version)
        await asyncio.wait_for(rtask, 10)
        return out

    out = asyncio.run(asyncio.wait_for(trainer(), 60))
    assert sorted(g.uid for g, _ in out) == sorted(f"e0-i{i}" for i in range(9))  # each prompt once
    assert ro.budget.starts == 9
    for g, version in out:
        assert len(g.responses) == n and sum(bool(r.sched.get("probe")) for r in g.responses) == 1
        assert g.responses[0].sched.get("probe")
        # the plain policy's staleness bound (tests/test_rollouter.py) holds unchanged
        assert version - g.min_version <= math.ceil(threshold) + (g.param_version_end - g.param_version_start)
        for r in g.responses:
            assert r.versions == sorted(r.versions)
            assert r.token_ids == [k % 7 + 1 for k in range(len(r))]
    stats = ro.policy.stats
    regenerated = sum(int(r.sched.get("regenerated_tokens", 0)) for g, _ in out for r in g.responses)
    assert stats.prompts == 9 and stats.regenerated_tokens == regenerated
    if not restart:
        assert regenerated == 0


def test_metrics_busy_latency_and_pdsr_keys(tmp_path):
    ro, q = make(6, batch_size=3, max_tokens=20)
    asyncio.run(asyncio.wait_for(produce(ro, q), 20))
    m = scheduling_metrics(ro, wall_s=1e6)
    assert set(m) >= {"rollout/replica0/busy_ratio", "rollout/replica1/busy_ratio", "rollout/group_latency_p50",
                      "rollout/group_latency_p95", "rollout/group_latency_p99", "pdsr/offload_count",
                      "pdsr/breaker_rate", "pdsr/breaker_prompt_rate", "pdsr/regenerated_tokens", "pdsr/topk_precision"}
    assert m["rollout/group_latency_p50"] <= m["rollout/group_latency_p95"] <= m["rollout/group_latency_p99"]
    assert all(0 < s for s in ro.replica_busy_seconds())
    assert m["pdsr/batches"] == 2 and m["pdsr/offload_count"] == 2  # round(0.2 * 3) = 1 per batch
    assert all(isinstance(v, float) for v in m.values())


# ---------------------------------------------------------------------- config and helpers
def test_heavy_replicas_are_the_last_indices_and_fast_ones_get_more_seqs():
    assert heavy_indices(3, 1) == (2,)
    assert heavy_indices(4, 2) == (2, 3)
    assert replica_max_num_seqs(3, 8, 1, 32) == [32, 32, 8]
    assert replica_max_num_seqs(3, 8, 1, None) == [8, 8, 8]
    for bad in (0, 3):
        with pytest.raises(ValueError, match="async_training.long_tail.heavy_replicas"):
            heavy_indices(3, bad)


def test_scheduling_from_config():
    assert scheduling_from_config(None, 2, 8, 4) == ("plain", {}, [8, 8])
    assert scheduling_from_config({"enable": False}, 2, 8, 4)[0] == "plain"
    lt = {"enable": True, "offload_ratio": 0.25, "cap_factor": 2.0, "cap_mode": "probe", "heavy_replicas": 1,
          "fast_max_num_seqs": 16, "restart": True, "batch_size": None, "batch_timeout_s": 0.5}
    name, kwargs, caps = scheduling_from_config(lt, 3, 8, 4)
    assert name == "pdsr" and caps == [16, 16, 8]
    assert kwargs == {"offload_ratio": 0.25, "cap_factor": 2.0, "cap_mode": "probe", "heavy_replicas": 1,
                      "restart": True, "batch_size": 4, "batch_timeout_s": 0.5}


def test_policy_rejects_bad_settings():
    with pytest.raises(ValueError, match="heavy_replicas"):
        make(1, engines=[FakeEngine()])
    with pytest.raises(ValueError, match="offload_ratio"):
        make(1, offload_ratio=1.5)
    with pytest.raises(ValueError, match="cap_mode"):
        make(1, cap_mode="own")


def test_schema_cap_modes_match_the_policy():
    assert S.PDSR_CAP_MODES == pdsr_policy.CAP_MODES


def test_config_check_names_the_key():
    from verl_async.config import ConfigError, compose, validate

    cfg = compose(overrides=["async_training.long_tail.enable=true", "rollout.n_gpus_per_node=1"])
    with pytest.raises(ConfigError, match="async_training.long_tail.heavy_replicas"):
        validate(cfg)
    ok = compose(overrides=["async_training.long_tail.enable=true", "rollout.n_gpus_per_node=2"])
    assert validate(ok).async_training.long_tail.offload_ratio == 0.2


def test_request_ids_parse():
    assert parse_request_id("0:17/3/42") == ("0:17", 3)
    assert parse_request_id("a/b/c/2/9") == ("a/b/c", 2)
    assert parse_request_id("val-1-2-3") is None


def test_policy_is_built_by_name():
    ro, _ = make(1)
    assert isinstance(ro.policy, PDSRPolicy) and ro.policy.heavy == (1,) and ro.policy.fast == (0,)


def test_every_scheduling_name_the_config_gives_has_a_policy_class():
    from verl_async.rollout.rollouter import PlainPolicy
    from verl_async.rollout.scheduling import policy_class

    lt = {"enable": True, "heavy_replicas": 1}
    assert policy_class(scheduling_from_config(None, 2, 8, 4)[0]) is PlainPolicy
    assert policy_class(scheduling_from_config(lt, 2, 8, 4)[0]) is PDSRPolicy
    with pytest.raises(ValueError, match=r"unknown rollout scheduling policy 'fifo'; available: \['pdsr', 'plain'\]"):
        policy_class("fifo")
