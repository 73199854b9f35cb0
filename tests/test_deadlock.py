"""The trainer does not wait forever for groups the Rollouter may not start (a leaked staleness slot)."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from verl_async.queue import MessageQueue
from verl_async.trainer import trainer as trainer_module
from verl_async.trainer.trainer import DeadlockError, Trainer
from verl_async.utils.timeline import Timeline

pytestmark = pytest.mark.slow


class StalledRollouter:
    """A RolloutService handle stand-in whose Rollouter idles `idle_s` on an exhausted budget (budget_stall)."""

    def __init__(self, idle_s: float) -> None:
        stall = {"idle_s": idle_s, "started": 2.0, "limit": 2.0, "version": 3.0}
        self.budget_stall = type("Method", (), {"remote": staticmethod(lambda: ray.put(stall))})()


def waiting_trainer(queue, rollouter) -> Trainer:
    t = Trainer.__new__(Trainer)
    t.group_source, t.queue, t.rollouter, t.required = None, queue, rollouter, 2
    t._stop, t.wait_s, t.version, t.dropped_stale = threading.Event(), 0.0, 3, 0
    t.timeline = Timeline(None, time.time())
    t.call_timeout_s = 60.0  # trainer.worker_timeout_s
    t.step, t.sync = 0, None  # no weights to push to a restarted replica (serve_replica_heals)
    t.oldest_first, t.off_policy_wait, t._wait_this_step = False, None, 0.0  # verl V1's sampler: off
    t._val_before = None  # no validation before training beside the wait
    return t


def test_trainer_raises_instead_of_waiting_forever(ray_session, monkeypatch):
    monkeypatch.setattr(trainer_module, "QUEUE_POLL_S", 0.2)
    monkeypatch.setattr(trainer_module, "STALL_LIMIT_S", 1.0)
    queue = ray.remote(MessageQueue).remote(4, 2)
    stalled = StalledRollouter(100.0)
    t0 = time.monotonic()
    with pytest.raises(DeadlockError, match=r"waited \d+ s for 2 groups.*2 of 2 groups started under version 3"):
        waiting_trainer(queue, stalled)._next_groups()
    assert time.monotonic() - t0 < 60  # a hang guard (the stall it reports is 100 s), not a speed target


def test_trainer_keeps_waiting_while_the_rollouter_works(ray_session, monkeypatch):
    monkeypatch.setattr(trainer_module, "QUEUE_POLL_S", 0.2)
    monkeypatch.setattr(trainer_module, "STALL_LIMIT_S", 0.5)
    queue = ray.remote(MessageQueue).remote(4, 2)
    busy = StalledRollouter(0.0)
    t = waiting_trainer(queue, busy)
    threading.Timer(2.0, t.stop).start()
    assert t._next_groups() == []  # stopped after 2 s, no error


def test_groups_dropped_as_too_stale_give_their_slots_back(ray_session):
    from verl_async.protocol import Response, RolloutSample

    released = []

    class Rollouter:
        release_budget = type("Method", (), {"remote": staticmethod(lambda n: ray.put(released.append(n)))})()

    def group(uid: str, version: int) -> RolloutSample:
        resp = Response(token_ids=[5], log_probs=[0.0], versions=[version], finish_reason="stop", reward=0.0)
        return RolloutSample(uid=uid, prompt_ids=[3], responses=[resp, resp])

    t = waiting_trainer(None, Rollouter())
    t.max_staleness, t.version = 1, 5
    keep = t._drop_too_stale([group("old", 2), group("new", 4), group("older", 1)])
    assert [g.uid for g in keep] == ["new"] and t.dropped_stale == 2 and released == [2]
