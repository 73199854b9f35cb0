"""Pure P-DSR planning: ranking, offload set, L_cut, cap, breaker, precision, counters."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_async.rollout import pdsr


def test_plan_lcut_cap_and_offload_set():
    plan = pdsr.plan_batch([10, 50, 30, 40, 20], offload_ratio=0.2, cap_factor=1.5)
    assert plan.order == (1, 3, 2, 4, 0)
    assert plan.heavy == (1,)
    assert plan.fast == (3, 2, 4, 0)
    assert plan.l_cut == 40              # longest probe that stays fast
    assert plan.fast_cap == 60
    assert plan.caps == (60, None, 60, 60, 60)
    assert plan.is_heavy(1) and not plan.is_heavy(0)
    assert plan.cap_for(1) is None and plan.cap_for(4) == 60


def test_cap_rounds_up_and_is_bounded():
    assert pdsr.fast_cap(5, 1.5) == 8                 # 7.5 -> 8
    assert pdsr.fast_cap(4, 1.5) == 6                 # exact product is not bumped
    assert pdsr.fast_cap(0, 1.5) == 1                 # an empty probe still allows 1 token
    assert pdsr.fast_cap(100, 2.0, max_response_length=150) == 150
    plan = pdsr.plan_batch([100, 90, 80], offload_ratio=0.0, cap_factor=3.0, max_response_length=128)
    assert (plan.l_cut, plan.fast_cap) == (100, 128)


def test_ties_keep_batch_order():
    plan = pdsr.plan_batch([5, 7, 5, 5, 7], offload_ratio=0.6, cap_factor=1.5)
    assert plan.order == (1, 4, 0, 2, 3)
    assert plan.heavy == (1, 4, 0)       # k = 3: the tie at the boundary goes to the earlier prompt
    assert plan.l_cut == 5 and plan.fast_cap == 8


def test_offload_ratio_zero_and_one():
    p0 = pdsr.plan_batch([3, 9, 6], offload_ratio=0.0, cap_factor=2.0)
    assert p0.heavy == () and p0.fast == (1, 2, 0)
    assert (p0.l_cut, p0.fast_cap) == (9, 18)
    p1 = pdsr.plan_batch([3, 9, 6], offload_ratio=1.0, cap_factor=2.0)
    assert p1.heavy == (1, 2, 0) and p1.fast == ()
    assert (p1.l_cut, p1.fast_cap) == (None, None)
    assert p1.caps == (None, None, None)


@pytest.mark.parametrize("batch,ratio,k", [
    (0, 0.2, 0), (1, 0.2, 0), (1, 0.5, 1), (2, 0.2, 0), (2, 0.25, 1), (3, 0.2, 1),
    (4, 0.2, 1), (5, 0.2, 1), (5, 0.3, 2), (10, 0.2, 2), (8, 0.0625, 1), (7, 1.0, 7)])
def test_num_offloaded_rounds_half_up(batch, ratio, k):
    assert pdsr.num_offloaded(batch, ratio) == k


def test_tiny_batches():
    empty = pdsr.plan_batch([], 0.2, 1.5)
    assert empty.order == () and empty.l_cut is None and empty.caps == ()
    one = pdsr.plan_batch([42], 0.2, 1.5)
    assert one.heavy == () and (one.l_cut, one.fast_cap) == (42, 63)
    one_heavy = pdsr.plan_batch([42], 0.5, 1.5)
    assert one_heavy.heavy == (0,) and one_heavy.fast_cap is None


def test_cap_mode_probe_caps_each_prompt_by_its_own_probe():
    plan = pdsr.plan_batch([10, 50, 30, 40, 20], 0.2, 1.5, cap_mode="probe")
    assert plan.caps == (15, None, 45, 60, 30)
    assert plan.fast_cap == 60 and plan.l_cut == 40


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="offload_ratio"):
        pdsr.plan_batch([1, 2], offload_ratio=1.5)
    with pytest.raises(ValueError, match="cap_factor"):
        pdsr.plan_batch([1, 2], cap_factor=0)
    with pytest.raises(ValueError, match=r"probe_lengths\[1\]"):
        pdsr.plan_batch([1, -2])
    with pytest.raises(ValueError, match="cap_mode"):
        pdsr.plan_batch([1], cap_mode="own")
    with pytest.raises(ValueError, match="prefix_len"):
        pdsr.continuation_max_tokens(300, 256)


def test_breaker_outcome_continue_and_restart():
    assert pdsr.breaker_outcome(50, 60) == pdsr.BreakerOutcome(False, 50, 0, 0)
    assert pdsr.breaker_outcome(60, 60) == pdsr.BreakerOutcome(False, 60, 0, 0)   # EOS at the cap
    assert pdsr.breaker_outcome(100, 60) == pdsr.BreakerOutcome(True, 60, 40, 0)
    assert pdsr.breaker_outcome(100, 60, restart=True) == pdsr.BreakerOutcome(True, 60, 100, 60)


def test_trips_breaker_only_on_a_length_stop_below_the_max():
    assert pdsr.trips_breaker("length", 60, 60, 4096)
    assert not pdsr.trips_breaker("stop", 60, 60, 4096)          # finished exactly at the cap
    assert not pdsr.trips_breaker("length", 4096, 4096, 4096)    # the real maximum
    assert not pdsr.trips_breaker("length", 60, None, 4096)      # heavy prompt: no cap
    assert pdsr.continuation_max_tokens(60, 4096) == 4036


def test_topk_precision_truth_mean_vs_max():
    # probes rank prompt 0 first; by mean prompt 1 is longest, by max prompt 2 is
    groups = [(100, 10, 10), (60, 60, 60), (5, 5, 200)]
    plan = pdsr.plan_batch([g[0] for g in groups], offload_ratio=0.34, cap_factor=1.5)
    assert plan.heavy == (0,)
    assert pdsr.topk_precision(plan, groups, "mean") == (0, 1)
    assert pdsr.topk_precision(plan, groups, "max") == (0, 1)
    plan2 = pdsr.plan_batch([60, 100, 5], offload_ratio=0.67, cap_factor=1.5)
    assert plan2.heavy == (1, 0)
    groups2 = [(60, 60, 60), (100, 10, 10), (5, 5, 200)]   # means 60, 40, 70; max 60, 100, 200
    assert pdsr.topk_precision(plan2, groups2, "mean") == (1, 2)   # true top-2 {2, 0}
    assert pdsr.topk_precision(plan2, groups2, "max") == (1, 2)    # true top-2 {2, 1}
    plan3 = pdsr.plan_batch([70, 10, 60], offload_ratio=0.67, cap_factor=1.5)
    assert plan3.heavy == (0, 2)
    assert pdsr.topk_precision(plan3, groups2, "mean") == (2, 2)   # exactly the true top-2 by mean
    assert pdsr.topk_precision(pdsr.plan_batch([1, 2], 0.0), [(1,), (2,)]) == (0, 0)
    with pytest.raises(ValueError, match="truth"):
        pdsr.topk_precision(plan, groups, "median")
    with pytest.raises(ValueError, match="prompts"):
        pdsr.topk_precision(plan, groups[:2])


def test_stats_counters_and_metric_names():
    stats = pdsr.PDSRStats()
    plan = pdsr.plan_batch([10, 50, 30, 40, 20], 0.2, 1.5)
    stats.record_plan(plan, n=4)
    stats.record_precision(plan, [(10,) * 4, (50,) * 4, (30,) * 4, (40,) * 4, (20,) * 4])
    stats.record_breaker()
    stats.record_breaker(regenerated_tokens=60, first_in_group=False)
    m = stats.metrics()
    assert m["pdsr/offload_count"] == 1
    assert m["pdsr/fast_responses"] == 12           # 4 fast prompts x 3 rest responses
    assert m["pdsr/breaker_count"] == 2
    assert m["pdsr/breaker_rate"] == pytest.approx(2 / 12)
    assert m["pdsr/topk_precision"] == 1.0
    assert m["pdsr/regenerated_tokens"] == 60
    assert m["pdsr/offload_rate"] == pytest.approx(0.2)
    assert m["pdsr/breaker_prompt_rate"] == pytest.approx(1 / 4)   # both breakers in one prompt
    assert pdsr.PDSRStats().metrics()["pdsr/topk_precision"] is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=40), st.floats(0, 1), st.floats(0.1, 4))
def test_plan_invariants(lengths, ratio, cap_factor):
    plan = pdsr.plan_batch(lengths, ratio, cap_factor)
    assert sorted(plan.heavy + plan.fast) == list(range(len(lengths)))
    assert len(plan.heavy) == pdsr.num_offloaded(len(lengths), ratio)
    if plan.heavy and plan.fast:
        assert min(lengths[i] for i in plan.heavy) >= max(lengths[i] for i in plan.fast)
    if plan.fast:
        assert plan.l_cut == max(lengths[i] for i in plan.fast)
        assert plan.fast_cap >= cap_factor * plan.l_cut - 1e-6
        assert plan.fast_cap >= 1
        assert all(plan.cap_for(i) == plan.fast_cap for i in plan.fast)
    assert all(plan.cap_for(i) is None for i in plan.heavy)
    assert plan == pdsr.plan_batch(list(lengths), ratio, cap_factor)   # deterministic
