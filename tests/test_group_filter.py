"""DAPO dynamic sampling (algorithm.filter_groups) at the Rollouter: spread check, queue, budget, bound, resume."""

import asyncio
import json

import pytest
import torch

from tests.test_rollouter import make, run_pipeline
from verl_async.protocol import Response, RolloutSample
from verl_async.rollout.group_filter import (
    FilterGroupsExhausted,
    GroupFilter,
    MissingFilterMetric,
    has_zero_spread,
    metric_value,
)
from verl_async.trainer.prepare import nonzero_advantage_metrics

ALL = [f"e0-i{i}" for i in range(8)]
EVEN = [u for u in ALL if int(u.split("i")[1]) % 2 == 0]
ODD = [u for u in ALL if u not in EVEN]


def response(reward: float = 0.0, **info: float) -> Response:
    return Response(token_ids=[1], log_probs=[-0.1], versions=[0], finish_reason="stop", reward=reward,
                    reward_info=dict(info))


def sample(uid: str, responses, source: str = "gsm8k") -> RolloutSample:
    return RolloutSample(uid=uid, prompt_ids=[1], responses=list(responses), data_source=source, index=0)


def within(coro, seconds: float):
    return asyncio.run(asyncio.wait_for(coro, seconds))


# --------------------------------------------------------------------------- pure checks
@pytest.mark.parametrize("values, zero", [
    ([1.0, 1.0, 1.0], True),
    ([0.0, 0.0], True),
    ([0.1, 0.1, 0.1], True),  # np.std of these is 1.4e-17, not 0: equality, not the float std
    ([1.0, 0.0, 1.0], False),
    ([0.5, 0.5000001], False),
    ([1.0], False),  # one response: kept, as verl does
    ([], False),
    ([None, None], False),  # failed scores: unknown, not equal
    ([1.0, None, 1.0], False),
])
def test_zero_spread(values, zero):
    assert has_zero_spread(values) is zero


def test_metric_values_by_verl_name():
    r = response(0.75, score=1.0, acc=1.0)  # reward = score + overlong penalty -0.25
    assert metric_value(r, "seq_reward") == 0.75 and metric_value(r, "seq_final_reward") == 0.75
    assert metric_value(r, "score") == 1.0 and metric_value(r, "acc") == 1.0
    assert metric_value(response(0.0, score=0.0, reward_error=1.0), "acc") is None
    with pytest.raises(MissingFilterMetric, match=r"^algorithm\.filter_groups\.metric: 'acc' is not in the reward "
                                                  r"info .*\['score'\]"):
        metric_value(response(0.0, score=0.0), "acc")


def test_filter_counts_per_source_and_bounds_the_run_in_a_row(tmp_path):
    log = tmp_path / "rollout" / "filtered_groups.jsonl"
    f = GroupFilter("acc", max_num_gen_batches=1, required_samples=2, log_path=str(log))
    flat = [response(0.0, acc=0.0)] * 2
    assert f.keep(sample("a", flat, "math"), version=3) is False
    assert f.keep(sample("b", flat), version=3) is False
    assert f.keep(sample("c", [response(acc=1.0), response(acc=0.0)]), version=3) is True  # resets the run
    assert f.in_a_row == 0
    assert not f.keep(sample("d", flat), 4) and not f.keep(sample("e", flat), 4)
    with pytest.raises(FilterGroupsExhausted, match=r"^algorithm\.filter_groups\.max_num_gen_batches: 3 groups in a "
                                                    r"row had the same 'acc' .*max_num_gen_batches x required_samples "
                                                    r"= 1 x 2 = 2 .*set it to 0 for no bound"):
        f.keep(sample("f", flat), 4)
    assert f.metrics() == {"fully_async/filtered_groups": 5.0, "fully_async/filtered_groups_in_a_row": 3.0,
                           "fully_async/filtered_groups/gsm8k": 4.0, "fully_async/filtered_groups/math": 1.0}
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["uid"], r["value"], r["version"]) for r in records] == [
        ("a", 0.0, 3), ("b", 0.0, 3), ("d", 0.0, 4), ("e", 0.0, 4), ("f", 0.0, 4)]


def test_filter_state_keeps_the_log_of_the_checkpoint_only(tmp_path):
    log = tmp_path / "filtered.jsonl"
    log.write_text('{"uid": "old-run"}\n')
    f = GroupFilter("score", log_path=str(log))
    flat = [response(score=1.0)] * 2
    f.keep(sample("a", flat), 0)  # a fresh run starts the log empty
    state = f.state_dict()
    f.keep(sample("b", flat), 1)  # after the checkpoint: lost with the crash
    assert [json.loads(x)["uid"] for x in log.read_text().splitlines()] == ["a", "b"]
    resumed = GroupFilter("score", log_path=str(log))
    resumed.load_state_dict(state)
    assert [json.loads(x)["uid"] for x in log.read_text().splitlines()] == ["a"]
    assert resumed.filtered == 1 and resumed.by_source == {"gsm8k": 1}
    resumed.keep(sample("b", flat), 1)
    assert [json.loads(x)["uid"] for x in log.read_text().splitlines()] == ["a", "b"]


def test_nonzero_advantage_share_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 9.0], [1e-9, -1e-9, 0.0], [0.0, 0.0, 0.0]])
    m = nonzero_advantage_metrics(adv, mask)  # row 1's 9.0 sits on padding; row 2 is rounding noise
    assert m == {"critic/nonzero_adv_frac": 0.25, "critic/nonzero_adv_samples": 1.0}


# --------------------------------------------------------------------------- at the Rollouter
async def even_prompts_all_wrong(item, responses):
    """Even prompts: every response scores 0 (zero spread); odd ones: 1 then 0 (kept)."""
    if item.index % 2 == 0:
        return [(0.0, {"acc": 0.0}) for _ in responses]
    return [(float(i == 0), {"acc": float(i == 0)}) for i in range(len(responses))]


def test_flat_groups_never_reach_the_queue_and_give_their_slot_back():
    # Strictly on-policy: 2 groups per version. A filtered group that kept its slot would leave the
    # trainer waiting for a second group that the Rollouter may not start: run_pipeline would time out.
    gf = GroupFilter("acc")
    ro, q = make(8, n=2, required=2, trigger=1, threshold=0.0, scorer=even_prompts_all_wrong, group_filter=gf)
    seen, stale, version = within(run_pipeline(ro, q, 2, 1, 2), 30)
    assert sorted(seen) == ODD and set(stale) == {0}  # full, on-policy batches of usable groups only
    assert version == 2
    assert gf.filtered == 4 and gf.by_source == {"": 4}
    assert ro.counters.started_groups == 8 and ro.counters.finished_groups == 4


def test_filtered_slot_lets_a_replacement_start_under_the_same_version():
    gf = GroupFilter("acc")
    ro, q = make(8, n=2, required=2, trigger=1, threshold=0.0, scorer=even_prompts_all_wrong, group_filter=gf)

    async def first_batch():
        task = asyncio.create_task(ro.run())
        batch = await q.get_batch(2, timeout=10)  # no sync yet: only returned slots can produce it
        started = ro.counters.started_groups
        ro.stop()
        await asyncio.wait_for(task, 10)
        return batch, started

    batch, started = within(first_batch(), 20)
    assert sorted(g.uid for g in batch) == ["e0-i1", "e0-i3"] and all(g.param_version_end == 0 for g in batch)
    assert started == 4 and gf.filtered == 2  # 2 slots came back from e0-i0 and e0-i2


async def always_flat(item, responses):
    return [(1.0, {"acc": 1.0}) for _ in responses]


def test_too_many_flat_groups_in_a_row_stop_the_run_naming_the_key():
    gf = GroupFilter("acc", max_num_gen_batches=1, required_samples=2)
    ro, q = make(8, n=2, required=2, trigger=1, threshold=0.0, scorer=always_flat, group_filter=gf)
    # No trainer and no sync: the returned slots alone keep the Rollouter going until the bound stops it.
    with pytest.raises(FilterGroupsExhausted, match=r"max_num_gen_batches: 3 groups in a row had the same 'acc'"):
        within(ro.run(), 30)
    assert q.size() == 0 and gf.filtered >= 3  # a group still in flight may be judged before the run ends


def test_unbounded_filter_ends_with_the_data_when_nothing_is_usable():
    gf = GroupFilter("acc")
    ro, q = make(6, n=2, required=2, trigger=1, threshold=0.0, scorer=always_flat, group_filter=gf)
    seen, _, version = within(run_pipeline(ro, q, 2, 1, 2), 30)
    assert seen == [] and version == 0 and gf.filtered == 6


async def no_acc(item, responses):
    return [(float(i), {"score": float(i)}) for i in range(len(responses))]


def test_metric_the_scorer_does_not_return_stops_the_run():
    ro, q = make(4, n=2, required=2, trigger=1, threshold=0.0, scorer=no_acc, group_filter=GroupFilter("acc"))
    with pytest.raises(MissingFilterMetric, match=r"algorithm\.filter_groups\.metric: 'acc'"):
        within(ro.run(), 30)
    assert q.size() == 0


def test_group_scored_while_paused_is_judged_after_the_sync():
    """A checkpoint taken during the pause must see the group as pending, not half-filtered."""
    release = asyncio.Event()

    async def slow_flat(item, responses):
        await release.wait()
        return [(0.0, {"acc": 0.0}) for _ in responses]

    gf = GroupFilter("acc")
    ro, q = make(1, n=2, required=1, trigger=1, threshold=0.0, scorer=slow_flat, partial=False, group_filter=gf)

    async def go():
        task = asyncio.create_task(ro.run())
        while not ro._inflight or ro._running_requests or ro.counters.generated_tokens == 0:
            await asyncio.sleep(0.01)
        await ro.pause_for_sync()
        release.set()
        await asyncio.sleep(0.2)
        assert gf.filtered == 0 and [t.uid for t in ro.pending_items()] == ["e0-i0"]
        await ro.load_weights([("w", torch.ones(1))], 1)
        await ro.resume_after_sync(1)
        await task
        assert gf.filtered == 1 and q.size() == 0 and ro.pending_items() == []
        assert ro.budget.started == 0  # started under version 1's budget (outstanding 1), then freed

    within(go(), 10)


# --------------------------------------------------------------------------- exactly-once resume (RolloutService)
class LocalQueue:
    """The MessageQueue as the service's actor handle (`handle.method.remote(...)` awaitable), in-process."""

    def __init__(self, queue) -> None:
        self.queue = queue

    def __getattr__(self, name):
        method = getattr(self.queue, name)

        class Remote:
            @staticmethod
            async def remote(*args):
                out = method(*args)
                return await out if asyncio.iscoroutine(out) else out

        return Remote()


def filtering_service(tmp_path, model_dir, files, requested: list):
    from tests.fakes import FakeEngine
    from tests.test_rollout_service_faults import _service
    from verl_async.queue import MessageQueue

    engine = FakeEngine(max_len=6, fail_when=lambda r: requested.append(r.request_id.split("/")[0]) and False)
    svc = _service(tmp_path, model_dir, files, [engine], "async_training.staleness_threshold=0",
                   "async_training.trigger_parameter_sync_step=1", "algorithm.filter_groups.enable=true",
                   "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=4")
    svc.rollouter.scorer = even_prompts_all_wrong  # the flat groups are known: even dataset rows
    queue = MessageQueue(capacity=svc.limit, group_size=2)
    svc.queue = LocalQueue(queue)
    svc.rollouter.sink.queue = svc.queue
    return svc, queue


async def train(svc, queue, steps=None, checkpoint_after=None):
    """The trainer's side: 2 groups per step, a sync after each; a checkpoint while paused after step k."""
    ro, trained, checkpoint = svc.rollouter, [], None
    run = asyncio.create_task(svc.run())
    while steps is None or len(trained) < steps:
        batch = await queue.get_batch(2, timeout=20)
        if not batch:
            break
        trained.append([g.uid for g in batch])
        await ro.pause_for_sync()
        if len(trained) == checkpoint_after:
            checkpoint = (svc.state_dict(), queue.snapshot(), len(trained))
        await ro.resume_after_sync(ro.version + 1)
    if steps is not None:  # the crash: everything after the checkpoint is lost
        ro.stop()
    await asyncio.wait_for(run, 20)
    return trained, checkpoint


def test_resume_neither_regenerates_nor_trains_a_filtered_prompt(tmp_path, tiny_model_dir):
    from verl_async.data import builtin, write_rows

    rows = builtin.generate_rows("train", 12, seed=3)
    write_rows(rows, str(tmp_path / "train.parquet"))
    write_rows(builtin.generate_rows("val", 2, seed=4), str(tmp_path / "val.parquet"))
    files = (str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet"))

    first_requests: list = []
    svc, queue = filtering_service(tmp_path, tiny_model_dir, files, first_requests)
    trained, checkpoint = asyncio.run(train(svc, queue, steps=3, checkpoint_after=2))
    state, snapshot, steps_done = checkpoint
    filtered_before = [json.loads(x)["uid"] for x in open(tmp_path / "run" / "rollout" / "filtered_groups.jsonl")]
    assert 1 <= state["filtered"]["filtered"] <= len(filtered_before)
    svc.reward.close()

    second_requests: list = []
    svc2, queue2 = filtering_service(tmp_path, tiny_model_dir, files, second_requests)
    asyncio.run(queue2.restore(snapshot))
    svc2.load_state_dict(state, [g["uid"] for g in snapshot])
    trained2, _ = asyncio.run(train(svc2, queue2))
    svc2.reward.close()

    filtered = [json.loads(x) for x in open(tmp_path / "run" / "rollout" / "filtered_groups.jsonl")]
    kept_before = [u for step in trained[:steps_done] for u in step]
    kept_after = [u for step in trained2 for u in step]
    filtered_uids = [r["uid"] for r in filtered]
    everything = kept_before + kept_after + filtered_uids
    assert sorted(everything) == sorted(set(everything)) and len(everything) == 12  # each prompt once
    assert all(r["index"] % 2 == 0 for r in filtered) and len(filtered) == 6
    assert all(len(step) == 2 for step in trained[:steps_done] + trained2)  # full batches
    consumed = filtered_uids[: state["filtered"]["filtered"]]  # filtered before the checkpoint
    assert consumed and not set(consumed) & set(second_requests)  # never generated again
    assert svc2.group_filter.filtered == 6
