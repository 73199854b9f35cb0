"""Simulator mechanics: replica model, admission, staleness gate, P-DSR invariants."""

from collections import Counter
from dataclasses import replace

import pytest

from verl_async.sim import (ConstantSpeed, GroupSpec, PDSRConfig, SimConfig, StepLatencySpeed,
                            TableSpeed, max_required_samples, policy_config, simulate,
                            synthetic_groups)
from verl_async.sim.speed import parse_speed, speed_from_dict

ONE = [GroupSpec("g0", 2, (4, 6))]
TINY = SimConfig(n=2, ppo_mini_batch_size=1, max_response_length=10, replicas=1,
                 speed=ConstantSpeed(1.0), train_a=1.0)


def test_batch_dependent_speed_is_a_fluid_model():
    # 2 running: 1 tok/s each until the 4-token one ends at t=4; then alone at 2 tok/s:
    # the 6-token one has 2 left -> done at 5. Train 1 s -> wall 6.
    cfg = replace(TINY, speed=TableSpeed((1.0, 2.0), (2.0, 1.0)))
    res = simulate(policy_config(cfg, "sync"), ONE)
    assert [r.end for r in res.groups[0].responses] == [4.0, 5.0]
    assert res.summary["wall_time"] == 6.0


@pytest.mark.parametrize("kv_admission,budget,ends", [
    ("reserve", 12, [4.0, 10.0]),   # each reserves prompt 2 + max 10 = 12: one at a time
    ("reserve", 24, [4.0, 6.0]),
    ("actual", 12, [4.0, 10.0]),    # 2+4 + 2+6 = 14 > 12
    ("actual", 14, [4.0, 6.0]),     # both fit with their real lengths
])
def test_kv_admission(kv_admission, budget, ends):
    cfg = replace(TINY, kv_budget_tokens=budget, kv_admission=kv_admission)
    res = simulate(policy_config(cfg, "sync"), ONE)
    assert sorted(r.end for r in res.groups[0].responses) == ends


def test_max_num_seqs_serialises():
    res = simulate(policy_config(replace(TINY, max_num_seqs=1), "sync"), ONE)
    assert [(r.start, r.end) for r in res.groups[0].responses] == [(0.0, 4.0), (4.0, 10.0)]


def test_kv_budget_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_budget_tokens 11 < 12"):
        simulate(policy_config(replace(TINY, kv_budget_tokens=11), "sync"), ONE)


@pytest.mark.parametrize("bad,match", [
    (dict(n=3), "has 2 responses, n = 3"),
    (dict(max_response_length=5), "max_response_length 5"),
    (dict(num_steps=2), "enough for 1..1 steps"),
    (dict(kv_admission="lazy"), "kv_admission"),
    (dict(replicas=1, dispatch="pdsr"), "heavy_replicas"),
    (dict(queue_capacity=0), "queue_capacity"),
])
def test_bad_settings_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        simulate(replace(TINY, **bad), ONE)


def test_max_required_samples_formula():
    assert max_required_samples(64, 4, 0.2) == 307        # verl int(64 * 1.2 * 4) = 307
    assert max_required_samples(2, 1, 0.5) == 3
    assert max_required_samples(10, 1, 0.1) == 11         # 10 * 1.1 = 11.000000000000002
    assert max_required_samples(4, 2, 0.0) == 8


def test_speed_models_parse_and_roundtrip():
    for spec in ("const:50", "latency:0.02,0.0002", "table:1=60,32=45,64=30"):
        m = parse_speed(spec)
        assert speed_from_dict(m.to_dict()) == m
    assert StepLatencySpeed(0.02, 0.0002).tokens_per_s(100) == pytest.approx(25.0)
    assert TableSpeed((1.0, 3.0), (30.0, 10.0)).tokens_per_s(2) == 20.0
    assert TableSpeed((1.0, 3.0), (30.0, 10.0)).tokens_per_s(9) == 10.0
    with pytest.raises(ValueError, match="--speed"):
        parse_speed("fast:1")
    with pytest.raises(ValueError, match="c0 > 0"):
        StepLatencySpeed(0.0, 1.0)


def _long_tail_cfg(**kw) -> SimConfig:
    base = SimConfig(n=4, ppo_mini_batch_size=8, max_response_length=4096, replicas=3,
                     speed=StepLatencySpeed(0.01, 0.0002), max_num_seqs=32,
                     kv_budget_tokens=40000, train_a=2.0, train_b=2e-5, sync_time=1.0,
                     staleness_threshold=0.5, trigger_parameter_sync_step=2,
                     pdsr=PDSRConfig(offload_ratio=0.25, cap_factor=1.5, fast_max_num_seqs=64))
    return replace(base, **kw)


WORK = synthetic_groups(160, 4, "longtail", seed=3)


@pytest.mark.parametrize("policy", ["sync", "async", "pdsr", "sync-pdsr"])
@pytest.mark.parametrize("partial", [True, False])
def test_staleness_gate_and_group_integrity(policy, partial):
    cfg = policy_config(_long_tail_cfg(partial_rollout=partial), policy)
    res = simulate(cfg, WORK)
    s = res.summary
    assert s["steps"] == len(WORK) // cfg.required_samples
    # never more than max_required_samples groups started under one version
    per_version = Counter(g.param_version_start for g in res.groups)
    assert max(per_version.values()) <= cfg.max_required
    for g in res.groups:
        assert len(g.responses) == cfg.n and all(r is not None for r in g.responses)
        assert [r.len for r in g.responses] == list(WORK[g.gid].lengths)
        assert g.finish_time == max(r.end for r in g.responses)
        if cfg.dispatch == "pdsr":
            assert sum(r.probe for r in g.responses) == 1      # one probe, merged with its rest
    trained = [g for g in res.groups if g.trained_step is not None]
    assert len(trained) == s["steps"] * cfg.required_samples
    if not partial:   # syncs wait for in-flight responses: none spans a version change
        assert all(r.min_version == r.max_version for g in res.groups for r in g.responses)
    if policy.startswith("sync"):
        assert s["staleness"]["max"] == 0
    assert 0 < s["pipeline_efficiency"] <= 1


def test_pdsr_breaker_accounting_continue_vs_restart():
    cont = simulate(policy_config(_long_tail_cfg(), "pdsr"), WORK)
    rest = simulate(policy_config(_long_tail_cfg(pdsr=replace(_long_tail_cfg().pdsr, restart=True)),
                                  "pdsr"), WORK)
    assert cont.summary["pdsr/breaker_count"] > 0
    assert cont.summary["regenerated_tokens"] == 0
    assert rest.summary["regenerated_tokens"] > 0
    for res, restart in ((cont, False), (rest, True)):
        for g in res.groups:
            for r in g.responses:
                if r.moved:
                    fast, heavy = r.segments
                    assert fast[0] != heavy[0]                     # changed replica
                    assert r.len > fast[2]                         # it really hit the cap
                    assert heavy[2] == (r.len if restart else r.len - fast[2])
                    assert r.regenerated_tokens == (fast[2] if restart else 0)


def test_pdsr_offload_ratio_zero_sends_nothing_heavy_but_breakers():
    cfg = policy_config(_long_tail_cfg(pdsr=PDSRConfig(offload_ratio=0.0, cap_factor=1.0)), "pdsr")
    res = simulate(cfg, WORK)
    assert res.summary["pdsr/offload_count"] == 0
    first_replicas = {r.segments[0][0] for g in res.groups for r in g.responses if not r.probe and not r.moved}
    assert 2 not in first_replicas        # replica 2 (heavy) runs no first segment of a rest response


def test_deterministic():
    cfg = policy_config(_long_tail_cfg(), "pdsr")
    a, b = simulate(cfg, WORK).summary, simulate(cfg, WORK).summary
    assert a == b
    assert synthetic_groups(50, 4, seed=7) == synthetic_groups(50, 4, seed=7)
    assert synthetic_groups(50, 4, seed=7) != synthetic_groups(50, 4, seed=8)


@pytest.mark.parametrize("policy", ["async", "pdsr"])
def test_inflight_limit_bounds_concurrent_groups(policy):
    # the P-DSR batch (8 prompts) is larger than the in-flight limit: it shrinks, no stall
    cfg = policy_config(_long_tail_cfg(max_inflight_groups=3), policy)
    res = simulate(cfg, WORK[:48])
    events = sorted([(g.submit_time, 1) for g in res.groups] + [(g.finish_time, -1) for g in res.groups])
    live = peak = 0
    for _, d in events:      # finishes sort before submits at the same instant
        live += d
        peak = max(peak, live)
    assert peak == 3
    assert res.summary["steps"] == 6
