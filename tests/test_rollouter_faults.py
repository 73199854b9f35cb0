"""Fault injection on the Rollouter (scripted FakeEngine failures): no hang, no lost prompt, a clear stop."""

import asyncio
import json

import pytest
import torch

from tests.fakes import FakeEngine
from tests.test_rollouter import make, run_pipeline
from verl_async.rollout.health import EngineFailure, ReplicaHealth
from verl_async.staleness import StalenessBudget

ALL = [f"e0-i{i}" for i in range(6)]


def fails_for(uid: str, times: int):
    """A fail_when that fails the first `times` requests of response 0 of prompt `uid` (then it serves)."""
    seen = [0]

    def pick(request) -> bool:
        if not request.request_id.startswith(uid + "/0/"):
            return False
        seen[0] += 1
        return seen[0] <= times

    return pick


def within(coro, seconds: float):
    return asyncio.run(asyncio.wait_for(coro, seconds))


def test_dropped_group_gives_its_budget_back_and_its_prompt_is_retried():
    # On-policy (threshold 0, trigger 1): one group that keeps its slot is a deadlock.
    ro, q = make(6, n=2, required=2, trigger=1, threshold=0.0,
                 engine_list=[FakeEngine(seed=1, fail_when=fails_for("e0-i1", 3))])
    seen, stale, _ = within(run_pipeline(ro, q, 2, 1, 2), 20)
    assert sorted(seen) == ALL and set(stale) == {0}
    assert ro.counters.dropped_groups_engine_error == 1 and ro.counters.retried_prompts == 1
    assert ro.counters.failed_prompts == 0 and ro.counters.started_groups == 6


def test_prompt_that_always_fails_is_counted_and_the_run_ends(tmp_path):
    log = tmp_path / "rollout" / "failed_prompts.jsonl"
    always = fails_for("e0-i1", 10**9)
    ro, q = make(6, n=2, required=2, trigger=1, threshold=0.0, max_prompt_retries=2, failed_log=str(log),
                 engine_list=[FakeEngine(seed=1, fail_when=always)])
    seen, _, _ = within(run_pipeline(ro, q, 2, 1, 2), 20)
    assert sorted(seen) == [u for u in ALL if u != "e0-i1"]
    assert ro.counters.failed_prompts == 1 and ro.counters.retried_prompts == 2
    assert ro.counters.dropped_groups_engine_error == 3
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["uid"], r["attempts"]) for r in records] == [("e0-i1", 3)]
    assert "injected failure" in records[0]["error"]


def test_retried_prompt_is_in_the_pending_state():
    """A prompt waiting for its retry is pending (a checkpoint then keeps it)."""
    ro, _ = make(4, n=2, required=2, trigger=1, threshold=0.0,
                 engine_list=[FakeEngine(seed=1, fail_when=fails_for("e0-i0", 3))])
    item = ro.prompts.next()

    async def go():
        ro._start_group(item)
        await asyncio.wait([t for _, t in list(ro._inflight.values())])

    asyncio.run(go())
    assert [t.uid for t in ro.pending_items()] == ["e0-i0"] and ro.unstarted_pending() == 1
    assert ro.pending_items()[0].attempts == 1 and ro.budget.started == 0


def test_failing_replica_leaves_the_rotation_and_the_run_completes():
    after_out = []
    bad = FakeEngine(seed=1, fail_when=lambda r: after_out.append(0 in ro.health.out) or True,
                     error="CUDA error: an illegal memory access")
    ro, q = make(6, n=2, required=2, trigger=1, threshold=0.5, max_consecutive_engine_failures=3,
                 engine_list=[bad, FakeEngine(seed=2)])
    seen, _, _ = within(run_pipeline(ro, q, 2, 1, 2), 20)
    assert sorted(seen) == ALL
    assert list(ro.health.out) == [0] and ro.counters.replicas_out_of_rotation == 1
    assert "illegal memory access" in ro.health.out[0]
    assert ro.counters.dropped_groups_engine_error == 0  # a failed request is retried on the other replica
    assert after_out.count(False) >= 3 and not any(after_out)  # nothing was sent to it once out


def test_every_replica_failing_stops_the_run_with_the_engine_error():
    engines = [FakeEngine(seed=k, fail_when=lambda r: True, error=f"NaN logits on replica {k}") for k in range(2)]
    ro, q = make(50, n=2, required=2, trigger=1, threshold=0.0, max_consecutive_engine_failures=4,
                 engine_list=engines)

    async def go():
        try:
            await ro.run()
        finally:
            await q.close()

    with pytest.raises(EngineFailure, match=r"every engine replica is out of rotation.*NaN logits on replica 0.*"
                                            r"NaN logits on replica 1"):
        within(go(), 10)


def test_replica_health_counts_consecutive_failures_only():
    h = ReplicaHealth(2, max_consecutive_failures=2)
    assert not h.record(0, "x") and not h.record(0, None) and not h.record(0, "y")  # a success resets
    assert h.record(0, "z") and h.serving() == [1] and h.serving([0]) == [1]
    assert not h.record(0, "again")  # reported once
    assert h.record(1, "a") is False and h.record(1, "b") and h.all_out


def test_budget_slot_of_an_abandoned_group_is_free_again():
    b = StalenessBudget(1)
    b.on_start()
    assert not b.can_start()
    b.on_abandon()
    assert b.can_start()


def test_finished_group_waits_with_its_put_while_paused():
    """A put inside a sync would land between the two halves of a checkpoint."""
    release = asyncio.Event()

    async def slow_score(item, responses):
        await release.wait()
        return [(0.0, {}) for _ in responses]

    ro, q = make(1, n=2, required=1, trigger=1, threshold=0.0, scorer=slow_score, partial=False)

    async def go():
        task = asyncio.create_task(ro.run())
        while not ro._inflight or ro._running_requests or ro.counters.generated_tokens == 0:
            await asyncio.sleep(0.01)
        await ro.pause_for_sync()  # generation done, the group is being scored
        release.set()
        await asyncio.sleep(0.2)
        assert q.size() == 0 and [t.uid for t in ro.pending_items()] == ["e0-i0"]
        await ro.load_weights([("w", torch.ones(1))], 1)
        await ro.resume_after_sync(1)
        await task
        assert q.size() == 1

    within(go(), 10)


def test_idle_on_an_exhausted_budget_is_measured():
    """What the trainer's deadlock check reads: a budget slot that never came back, nothing in flight."""
    ro, q = make(4, n=2, required=2, trigger=1, threshold=0.0)
    ro.budget.started = ro.budget.limit  # two slots leaked

    async def go():
        task = asyncio.create_task(ro.run())
        await asyncio.sleep(0.3)
        idle = ro.idle_on_budget_s()
        await ro.resume_after_sync(1)  # a sync frees the budget
        assert ro.idle_on_budget_s() == 0.0
        ro.stop()
        await asyncio.wait_for(task, 10)
        return idle

    assert within(go(), 10) >= 0.25


def test_run_where_every_prompt_failed_is_an_engine_failure():
    """Too few requests to put a replica out of rotation, every one failed: not a successful run of 0 groups."""
    engines = [FakeEngine(fail_when=lambda r: True, error="out of memory")]
    ro, q = make(2, n=2, required=2, trigger=1, threshold=0.0, max_consecutive_engine_failures=10**6,
                 engine_list=engines)
    with pytest.raises(EngineFailure, match=r"no group was generated: all 2 prompts failed.*out of memory"):
        within(ro.run(), 10)


@pytest.mark.parametrize("release", [True, False])
def test_groups_the_trainer_drops_as_too_stale_free_their_budget(release):
    # On-policy budget of 2 groups per version: the trainer drops the first 2 (as algorithm.max_staleness
    # would) and needs 2 more before it syncs. Only released slots let the Rollouter make them.
    ro, q = make(6, n=2, required=2, trigger=1, threshold=0.0)

    async def scenario():
        rtask = asyncio.create_task(ro.run())
        dropped = await q.get_batch(2, timeout=10)
        assert len(dropped) == 2
        if release:
            ro.release_budget(len(dropped))
        try:
            kept = await q.get_batch(2, timeout=3)
        except asyncio.TimeoutError:
            kept = []
        rtask.cancel()
        return kept

    kept = within(scenario(), 20)
    if release:
        assert len(kept) == 2 and ro.budget.started == 4 - 2
    else:
        assert not kept  # the old behaviour: nothing comes, the trainer would wait for ever


# --------------------------------------------------------------------------- debug.fail_replicas
def test_fail_replicas_names_replicas_by_index_or_all():
    from verl_async.rollout.faults import replica_fails

    assert [replica_fails(i, None) for i in range(3)] == [False, False, False]
    assert [replica_fails(i, "all") for i in range(3)] == [True, True, True]
    assert [replica_fails(i, [0, 2]) for i in range(3)] == [True, False, True]
    with pytest.raises(ValueError, match=r"debug\.fail_replicas: expected null, all or a list"):
        replica_fails(0, "0,2")


def test_a_failing_replica_answers_every_request_with_the_injected_error():
    from verl_async.rollout.engine import GenerateRequest
    from verl_async.rollout.faults import FailingEngine, with_faults

    inner = FakeEngine(seed=1)
    assert with_faults(inner, 1, [0]) is inner
    engine = with_faults(inner, 0, [0])
    assert isinstance(engine, FailingEngine)
    result = within(engine.generate(GenerateRequest("r0", [1, 2], prefix_token_ids=[5], prefix_log_probs=[-0.5],
                                                    prefix_versions=[3])), 5)
    assert result.error == "injected failure on replica 0 (debug.fail_replicas=[0])"
    assert (result.token_ids, result.log_probs, result.versions, result.finish_reason) == ([5], [-0.5], [3], "abort")
    assert inner.calls == 0  # the request never reached the engine
