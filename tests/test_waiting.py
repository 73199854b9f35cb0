"""One deadline over many Ray refs: each finished ref is handed over in turn, the late ones are named."""

import time

import pytest
import ray

from verl_async.utils.waiting import WaitTimeout, finished_in_turn


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
