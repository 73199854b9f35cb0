"""One deadline over many Ray refs: each finished ref is handed over in turn, the late ones are named; a wait past
its deadline names the config key that sets it (one call, the engine replicas' start)."""

import time

import pytest
import ray

from verl_async.utils.waiting import KeyedTimeout, WaitTimeout, finished_in_turn, get_within


def test_finished_refs_come_in_turn_and_the_late_ones_are_named(ray_session):
    @ray.remote(num_cpus=0.01)
    def after(seconds: float, value: int) -> int:
        time.sleep(seconds)
        return value

    refs = {"fast": after.remote(0.0, 1), "slow": after.remote(60.0, 2), "also fast": after.remote(0.1, 3)}
    got = {}
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout) as late:
        for key, ref, left in finished_in_turn(refs, 5.0):
            assert 1.0 <= left <= 5.0
            got[key] = ray.get(ref, timeout=left)
    assert got == {"fast": 1, "also fast": 3}
    assert late.value.pending == ["slow"]
    assert time.monotonic() - t0 < 30  # the deadline, not the slow task, ended the wait
    ray.cancel(refs["slow"], force=True)


def test_nothing_to_wait_for_returns_at_once():
    assert list(finished_in_turn({}, 0.0)) == []


def test_one_call_past_its_deadline_names_the_key(ray_session):
    @ray.remote(num_cpus=0.01)
    def after(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    assert get_within(after.remote(0.0), 30.0, "a quick call", "x.timeout_s") == 0.0
    slow = after.remote(60.0)
    with pytest.raises(KeyedTimeout) as late:
        get_within(slow, 1.0, "the queue's stats", "trainer.worker_timeout_s")
    assert str(late.value) == ("the queue's stats did not answer within 1 s (stuck or dead; raise "
                               "trainer.worker_timeout_s if it is only slow)")
    ray.cancel(slow, force=True)


def test_engine_replicas_that_do_not_start_in_time_name_the_key(ray_session, tiny_model_dir):
    from verl_async.rollout.replica import ReplicaSpec, ReplicaStartTimeout, start_replicas

    rollout_cfg = {"name": "native", "prompt_length": 16, "response_length": 16, "max_num_seqs": 2, "dtype": "float32"}
    with pytest.raises(ReplicaStartTimeout) as late:  # loading a model takes longer than 0.1 s
        start_replicas(2, ReplicaSpec(rollout_cfg, tiny_model_dir, "cpu"), timeout_s=0.1)
    assert str(late.value) == ("replica 0, replica 1 of 2 engine replica(s) did not load the model and start within "
                               "0.1 s (stuck or dead; raise rollout.start_timeout_s if only slow)")


def test_the_start_timeout_is_a_key_with_a_default_from_the_run():
    from omegaconf import OmegaConf

    from verl_async.config.derived import replica_start_timeout_s

    def cfg(start):
        return OmegaConf.create({"rollout": {"start_timeout_s": start}, "trainer": {"worker_timeout_s": 1800}})

    assert replica_start_timeout_s(cfg(None)) == 1800.0 and replica_start_timeout_s(cfg(90)) == 90.0
