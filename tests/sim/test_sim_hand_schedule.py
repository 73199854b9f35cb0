"""The simulator reproduces hand-computed schedules exactly (4 prompts, n = 2).

Common setting (all numbers exact in binary floating point):
  * constant decode speed 1 token/s per sequence, independent of the batch size,
    no KV limit, max_num_seqs 16 (never binding);
  * 4 prompts, prompt_len 2, n = 2, response lengths
        P0: [4, 2]   P1: [6, 6]   P2: [2, 16]   P3: [3, 5]
  * required_samples = ppo_mini_batch_size 2 * require_batches 1 = 2 groups -> 2 steps;
  * trainer step = a + b * tokens with a = 1, b = 0.25, tokens = sum(prompt_len + len):
        P0: 6 + 4 = 10   P1: 8 + 8 = 16   P2: 4 + 18 = 22   P3: 5 + 7 = 12
  * sync = 1 s; wall time = end of the last train step (no sync after it).
"""

from dataclasses import replace

import pytest

from verl_async.sim import ConstantSpeed, GroupSpec, PDSRConfig, SimConfig, policy_config, simulate

WORKLOAD = [GroupSpec(f"P{i}", 2, lens) for i, lens in
            enumerate([(4, 2), (6, 6), (2, 16), (3, 5)])]
BASE = SimConfig(n=2, ppo_mini_batch_size=2, max_response_length=32, replicas=1,
                 speed=ConstantSpeed(1.0), max_num_seqs=16, train_a=1.0, train_b=0.25,
                 sync_time=1.0)


def _by_uid(res):
    return {g.uid: g for g in res.groups}


def test_synchronous_baseline():
    # Step 1: generate P0, P1 together from t=0: P0 done at 4, P1 at 6 -> generation ends 6.
    #         train tokens 10 + 16 = 26 -> 1 + 6.5 = 7.5 s -> ends 13.5; sync 13.5 -> 14.5.
    # Step 2: generate P2, P3 from 14.5: P3 done 19.5, P2 (16 tokens) done 30.5.
    #         train tokens 22 + 12 = 34 -> 9.5 s -> ends 40.0 = wall.
    # replica busy 6 + 16 = 22 -> idle 18/40; trainer busy 7.5 + 9.5 = 17 -> idle 23/40;
    # efficiency max(22, 17)/40; staleness 0 everywhere; group latencies 4, 6, 5, 16.
    res = simulate(policy_config(BASE, "sync"), WORKLOAD)
    s = res.summary
    assert s["wall_time"] == 40.0
    assert [(st.start, st.end, st.tokens) for st in res.steps] == [(6.0, 13.5, 26), (30.5, 40.0, 34)]
    assert s["replicas"][0]["busy"] == 22.0
    assert s["replicas"][0]["idle_ratio"] == pytest.approx(18 / 40, rel=1e-12)
    assert s["trainer_busy"] == 17.0
    assert s["trainer_idle_ratio"] == pytest.approx(23 / 40, rel=1e-12)
    assert s["pipeline_efficiency"] == pytest.approx(22 / 40, rel=1e-12)
    assert s["sync_total"] == 1.0
    assert s["staleness"]["hist"] == {"0": 4}
    g = _by_uid(res)
    assert [g[u].finish_time - g[u].submit_time for u in ("P0", "P1", "P2", "P3")] == [4.0, 6.0, 16.0, 5.0]
    gen = [(sp["start"], sp["end"]) for sp in res.spans if sp["lane"] == "rollout/replica0"]
    assert gen == [(0.0, 6.0), (14.5, 30.5)]
    assert [(sp["start"], sp["end"]) for sp in res.spans if sp["kind"] == "sync"] == [(13.5, 14.5)]


def test_async_partial_rollout_on():
    # staleness 0.5, trigger 1 -> max_required = int(2 * 1 * 1.5) = 3 groups per version.
    # t=0: submit P0, P1, P2 (count 3 = max: pause). P0 done 4, P1 done 6.
    # t=6: train [P0, P1] (26 tokens, 7.5 s) -> 13.5. Sync 13.5 -> 14.5: P2's 16-token
    #      response has 2.5 tokens left; it pauses for the sync and ends at 17.
    # t=14.5: version 1; count = in flight 1 (P2) + queued 0 = 1 -> submit P3 (done 19.5).
    # t=19.5: train [P2, P3] (34 tokens, 9.5 s) -> wall 29.0.
    # replica busy: 0 -> 13.5 and 14.5 -> 19.5 = 18.5; trainer busy 17.
    # staleness: step 1 (version 0): 0, 0; step 2 (version 1): P2 1, P3 0.
    cfg = policy_config(replace(BASE, staleness_threshold=0.5, partial_rollout=True), "async")
    res = simulate(cfg, WORKLOAD)
    s = res.summary
    assert s["max_required_samples"] == 3
    assert s["wall_time"] == 29.0
    assert [(st.start, st.end) for st in res.steps] == [(6.0, 13.5), (19.5, 29.0)]
    assert s["replicas"][0]["busy"] == 18.5
    assert s["trainer_busy"] == 17.0
    assert s["trainer_idle_ratio"] == pytest.approx(12 / 29, rel=1e-12)
    assert s["pipeline_efficiency"] == pytest.approx(18.5 / 29, rel=1e-12)
    assert s["staleness"]["hist"] == {"0": 3, "1": 1}
    g = _by_uid(res)
    assert (g["P2"].finish_time, g["P2"].param_version_start, g["P2"].param_version_end) == (17.0, 0, 1)
    long = g["P2"].responses[1]
    assert (long.start, long.end, long.min_version, long.max_version) == (0.0, 17.0, 0, 1)
    assert (g["P3"].submit_time, g["P3"].finish_time, g["P3"].param_version_start) == (14.5, 19.5, 1)
    gen = [(sp["start"], sp["end"]) for sp in res.spans if sp["lane"] == "rollout/replica0"]
    assert gen == [(0.0, 13.5), (14.5, 19.5)]


def test_async_partial_rollout_off():
    # As above, but the sync requested at 13.5 waits for P2 to finish (16.0), runs
    # 16 -> 17; version 1, count = 0 in flight + 1 queued (P2) -> submit P3 at 17, done 22.
    # t=22: train [P2, P3] 9.5 s -> wall 31.5. Replica busy 0 -> 16 and 17 -> 22 = 21.
    # The trainer waited 13.5 -> 16 for the drain.
    cfg = policy_config(replace(BASE, staleness_threshold=0.5, partial_rollout=False), "async")
    res = simulate(cfg, WORKLOAD)
    s = res.summary
    assert s["wall_time"] == 31.5
    assert [(st.start, st.end) for st in res.steps] == [(6.0, 13.5), (22.0, 31.5)]
    assert s["replicas"][0]["busy"] == 21.0
    assert s["drain_wait_total"] == 2.5
    g = _by_uid(res)
    assert (g["P2"].finish_time, g["P2"].param_version_end) == (16.0, 0)
    assert (g["P3"].submit_time, g["P3"].finish_time) == (17.0, 22.0)
    assert s["staleness"]["hist"] == {"0": 3, "1": 1}


def _pdsr_cfg(restart: bool) -> SimConfig:
    # 2 replicas: replica 0 fast, replica 1 heavy; staleness 1 -> max_required 4: one
    # P-DSR batch of all 4 prompts at t=0. offload_ratio 0.25 -> k = 1, cap_factor 1.5.
    return policy_config(replace(BASE, replicas=2, staleness_threshold=1.0,
                                 pdsr=PDSRConfig(offload_ratio=0.25, cap_factor=1.5, batch_size=4,
                                                 restart=restart)), "pdsr")


def test_pdsr_continue():
    # Probes (response 0) go least-loaded first, ties to the lower index:
    #   P0 -> r0, P1 -> r1, P2 -> r0, P3 -> r1. Done: P2 @2, P3 @3, P0 @4, P1 @6.
    # t=6 plan: rank P1(6) P0(4) P3(3) P2(2); heavy = {P1}; L_cut = 4; cap = 6.
    #   heavy pool: P1 rest (6) -> r1, 6 -> 12.
    #   fast pool (rank order): P0 rest (2) done 8; P3 rest (5) done 11;
    #   P2 rest (16) stops at the cap at 12 -> moved, continues on r1 with 10 left.
    # t=11: queue P0 (8), P3 (11) -> train (10 + 12 = 22 tokens, 6.5 s) -> 17.5.
    # sync 17.5 -> 18.5 pauses r1 (P2 has 4.5 tokens left) -> P2 done 23.
    # t=23: train [P1, P2] (16 + 22 = 38 tokens, 10.5 s) -> wall 33.5.
    # busy: r0 = 0-4 + 6-12 = 10; r1 = 0-17.5 minus idle? no: 0-6 probes, 6-17.5, 18.5-23 = 22.
    # P-DSR: 1 offloaded, 3 fast responses, 1 breaker; true top-1 by mean is P2 (9) -> precision 0.
    res = simulate(_pdsr_cfg(restart=False), WORKLOAD)
    s = res.summary
    assert s["wall_time"] == 33.5
    assert [(st.start, st.end, st.tokens) for st in res.steps] == [(11.0, 17.5, 22), (23.0, 33.5, 38)]
    assert [r["busy"] for r in s["replicas"]] == [10.0, 22.0]
    assert [r["role"] for r in s["replicas"]] == ["fast", "heavy"]
    assert s["trainer_busy"] == 17.0
    assert s["pdsr/offload_count"] == 1
    assert s["pdsr/fast_responses"] == 3
    assert s["pdsr/breaker_count"] == 1
    assert s["pdsr/breaker_rate"] == pytest.approx(1 / 3, rel=1e-12)
    assert s["pdsr/breaker_prompt_rate"] == pytest.approx(1 / 3, rel=1e-12)   # P2 of P0, P2, P3
    assert s["pdsr/topk_precision"] == 0.0
    assert s["regenerated_tokens"] == 0
    assert s["staleness"]["hist"] == {"0": 2, "1": 2}
    assert s["group_latency"]["p50"] == 11.5            # latencies 8, 11, 12, 23
    g = _by_uid(res)
    assert [g[u].finish_time for u in ("P0", "P1", "P2", "P3")] == [8.0, 12.0, 23.0, 11.0]
    probe, rest = g["P2"].responses
    assert (probe.probe, probe.replica, probe.start, probe.end) == (True, 0, 0.0, 2.0)
    assert (rest.moved, rest.replica, rest.start, rest.end, rest.len) == (True, 1, 6.0, 23.0, 16)
    assert rest.segments == [(0, 6.0, 6), (1, 12.0, 10)]   # prefix 6 on fast, 10 more on heavy
    assert (rest.min_version, rest.max_version) == (0, 1)
    assert [r.replica for r in g["P1"].responses] == [1, 1]  # offloaded prompt stays heavy


def test_pdsr_restart():
    # Same until t=12; the moved P2 rest restarts on r1: 16 tokens from 12, paused by the
    # sync 17.5 -> 18.5, done at 29; 6 tokens regenerated. Step 2 starts 29 -> wall 39.5.
    res = simulate(_pdsr_cfg(restart=True), WORKLOAD)
    s = res.summary
    assert s["wall_time"] == 39.5
    assert s["regenerated_tokens"] == 6
    assert [r["busy"] for r in s["replicas"]] == [10.0, 28.0]
    rest = _by_uid(res)["P2"].responses[1]
    assert rest.segments == [(0, 6.0, 6), (1, 12.0, 16)]
    assert rest.regenerated_tokens == 6
