"""BusyClock: busy time is the union of overlapping task spans (engine busy, rollout/idle_ratio)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verl_async.utils.busy_clock import BusyClock
from verl_async.utils.timeline import union_length


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_overlapping_spans_count_once_and_the_running_span_counts_so_far():
    now = FakeTime()
    clock = BusyClock(now)
    clock.start()          # t=0: task A
    now.t = 1.0
    clock.start()          # t=1: task B beside A
    now.t = 3.0
    clock.stop()           # t=3: A ends, B runs on
    assert clock.closed_s == 0.0 and clock.seconds() == 3.0
    now.t = 4.0
    clock.stop()           # t=4: B ends: busy 0..4 = 4 s, not 3 + 3
    now.t = 6.0
    assert clock.seconds() == 4.0 and clock.running == 0  # idle 4..6 does not count
    with clock.task():     # t=6..7
        now.t = 7.0
    assert clock.closed_s == 5.0


def test_a_task_that_raises_still_ends_its_span():
    now = FakeTime()
    clock = BusyClock(now)
    with pytest.raises(ValueError):
        with clock.task():
            now.t = 2.0
            raise ValueError("engine error")
    assert clock.running == 0 and clock.closed_s == 2.0


def test_stop_without_a_running_task_is_an_error():
    with pytest.raises(RuntimeError, match="without a running task"):
        BusyClock().stop()


@given(st.lists(st.tuples(st.integers(0, 100), st.integers(1, 30)), min_size=1, max_size=20))
def test_busy_seconds_equal_the_union_of_the_spans(spans):
    """Against the timeline's union (a separate implementation): events replayed in time order."""
    intervals = [(float(s), float(s + d)) for s, d in spans]
    events = sorted([(s, 1) for s, _ in intervals] + [(e, 0) for _, e in intervals])  # at a tie, stop first
    now = FakeTime()
    clock = BusyClock(now)
    for t, is_start in events:
        now.t = t
        clock.start() if is_start else clock.stop()
    assert clock.running == 0
    assert clock.closed_s == pytest.approx(union_length(intervals, 0.0, 1000.0))
