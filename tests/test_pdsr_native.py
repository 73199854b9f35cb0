"""P-DSR on real Ray replicas of the native engine (tiny model, CPU, greedy).

Lengths are scripted with TargetLengthEngine (ignore_eos + a per-response stop), so the
breaker fires where the test says; the tokens, log-probs and versions are the model's.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.fakes import ListSink, ListSource, no_score
from verl_async.rollout.engine import GenerateRequest, SamplingParams
from verl_async.rollout.pdsr_policy import PDSRPolicy
from verl_async.rollout.replica import ReplicaSpec, start_replicas
from verl_async.rollout.rollouter import PromptTask, Rollouter
from verl_async.rollout.scripted import TargetLengthEngine, parse_request_id
from verl_async.staleness import StalenessBudget

ROLLOUT_CFG = {"name": "native", "max_num_seqs": 2, "prompt_length": 16, "response_length": 48, "seed": 0}
PROMPTS = [[5, 17, 33, 9], [40, 41, 42], [7, 7, 8, 60, 61]]
# probes 12, 8, 20 -> P2 offloaded (round(0.2 * 3) = 1), L_cut 12, cap 18: P0's response 1 (30) moves
TARGETS = {"p0": [12, 30], "p1": [8, 8], "p2": [20, 20]}


class Recorder(TargetLengthEngine):
    """Scripted lengths, and every (request, result) kept for the assertions."""

    def __init__(self, inner, target, log):
        super().__init__(inner, target)
        self.log = log

    async def generate(self, request):
        result = await super().generate(request)
        self.log.append((self, request, result))
        return result


@pytest.fixture(scope="module")
def replicas(ray_session, tiny_model_dir):
    engines = start_replicas(2, ReplicaSpec(ROLLOUT_CFG, tiny_model_dir, "cpu"), timeout_s=180,
                             engine_overrides=[{"max_num_seqs": 4}, {"max_num_seqs": 2}])
    yield engines
    for e in engines:
        asyncio.run(e.shutdown())


def test_fast_replica_gets_fast_max_num_seqs(replicas):
    fast, heavy = (e.stats() for e in replicas)
    assert fast.kv_budget_tokens == 4 * 64 and heavy.kv_budget_tokens == 2 * 64  # slots * (16 + 48)


def test_capped_response_continues_on_heavy_with_identical_prefix(replicas):
    log: list = []
    engines = [Recorder(e, lambda uid, i: TARGETS[uid][i], log) for e in replicas]
    sink = ListSink()
    sampling = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, seed=0)
    prompts = ListSource(PromptTask(f"p{i}", i, 0, p) for i, p in enumerate(PROMPTS))
    ro = Rollouter(engines=engines, prompts=prompts, scorer=no_score, sink=sink, n=2, sampling=sampling,
                   budget=StalenessBudget(8), partial_rollout=True, max_inflight_groups=8,
                   scheduling=PDSRPolicy, scheduling_kwargs={"batch_size": 3, "batch_timeout_s": 30},
                   engine_capacity=[4, 2])
    assert isinstance(ro.policy, PDSRPolicy)
    asyncio.run(asyncio.wait_for(ro.run(), 120))

    groups = {g.uid: g for g in sink.groups}
    assert sorted(groups) == ["p0", "p1", "p2"]
    for uid, g in groups.items():
        g.validate(2)
        assert [len(r) for r in g.responses] == TARGETS[uid]
    moved = groups["p0"].responses[1]
    assert moved.sched["moved"] and moved.sched["regenerated_tokens"] == 0 and moved.replica == 1
    assert groups["p2"].responses[1].replica == 1 and groups["p1"].responses[1].replica == 0

    # the fast replica stopped it at the cap; the heavy replica got exactly that as its prefix
    calls = [(eng, req, res) for eng, req, res in log if parse_request_id(req.request_id) == ("p0", 1)]
    (fast_eng, _, capped), (heavy_eng, cont_req, _) = calls
    assert fast_eng is engines[0] and heavy_eng is engines[1]
    assert len(capped.token_ids) == 18 and capped.finish_reason == "length"
    assert cont_req.prefix_token_ids == capped.token_ids
    assert cont_req.prefix_log_probs == capped.log_probs and cont_req.prefix_versions == capped.versions
    assert moved.token_ids[:18] == capped.token_ids and moved.log_probs[:18] == capped.log_probs
    assert moved.versions == [0] * 30

    # greedy continuation == one uncapped greedy run of the same prompt
    ref = asyncio.run(replicas[1].generate(GenerateRequest(
        "ref", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))))
    assert ref.token_ids == moved.token_ids
    assert max(abs(a - b) for a, b in zip(ref.log_probs, moved.log_probs)) < 1e-4

    m = ro.policy.metrics()
    assert m["pdsr/offload_count"] == 1 and m["pdsr/breaker_count"] == 1
    assert m["pdsr/breaker_rate"] == pytest.approx(1 / 2) and m["pdsr/regenerated_tokens"] == 0


def test_service_wires_long_tail_config(tiny_model_dir, tmp_path):
    from tests.fakes import FakeEngine
    from verl_async.config import compose, validate
    from verl_async.rollout.service import RolloutService

    cfg = validate(compose(overrides=[
        "async_training.long_tail.enable=true", "async_training.long_tail.fast_max_num_seqs=12",
        "async_training.long_tail.restart=true", "rollout.n_gpus_per_node=3",
        "actor_rollout_ref.rollout.max_num_seqs=4", f"actor_rollout_ref.model.path={tiny_model_dir}",
    ]))
    service = RolloutService(cfg, None, model_path=tiny_model_dir, run_dir=str(tmp_path), run_start=time.time(),
                             engines=[FakeEngine(), FakeEngine(), FakeEngine()])
    ro = service.rollouter
    assert isinstance(ro.policy, PDSRPolicy) and ro.policy.restart
    assert ro.policy.heavy == (2,) and ro.engine_capacity == [12, 12, 4]
    assert ro.policy.batch_size == int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    assert ro.max_inflight_groups == (12 + 12 + 4) // int(cfg.actor_rollout_ref.rollout.n) + ro.policy.batch_size
    m = service.metrics()
    assert "pdsr/breaker_rate" in m and "rollout/replica2/busy_ratio" in m
