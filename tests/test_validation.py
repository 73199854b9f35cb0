"""Validation never kills a run or its checkpoint (issue 28, item 1).

The metrics are over the samples that exist, per prompt (a ragged list of per-prompt
scores used to raise `ValueError: setting an array element with a sequence` inside
`np.mean`); a validation that fails or times out is logged and training goes on; the
checkpoint is written before the validation; `test_freq <= 0` never validates.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import ray

from tests.fakes import FakeEngine
from verl_async.config import compose, validate
from verl_async.config.derived import finish_timeout_s, validation_timeout_s
from verl_async.reward import RewardFunctionError
from verl_async.reward.manager import Reward as RewardManagerResult
from verl_async.rollout.engine import SamplingParams
from verl_async.rollout.health import ReplicaLost
from verl_async.rollout.validation import ScoredPrompt, ValidationError, Validator, validation_metrics
from verl_async.trainer.trainer import VALIDATION_GRACE_S, Trainer
from verl_async.utils.busy_clock import BusyClock
from verl_async.utils.timeline import Timeline


# --------------------------------------------------------------------------- the metrics
def test_metrics_average_each_prompt_over_the_samples_it_has():
    prompts = [
        ScoredPrompt("a", scores=[1.0, 0.0], accs=[1.0, 0.0]),  # lost 1 of its 3 samples
        ScoredPrompt("a", scores=[0.5], accs=[1.0]),  # lost 2
        ScoredPrompt("b", scores=[0.0, 0.0, 0.0], accs=[0.0, 0.0, 0.0]),
    ]  # a fourth prompt lost all 3 and is left out
    out = validation_metrics(3, prompts, [4, 6, 2, 1, 1, 1, 3], requested=12, failed=5, reward_errors=1)
    assert out == pytest.approx({
        "val/mean@3/score": (0.5 + 0.5 + 0.0) / 3,
        "val/mean@3/acc": (0.5 + 1.0 + 0.0) / 3,
        "val/pass@3/acc": (1.0 + 1.0 + 0.0) / 3,
        "val/response_length/mean": 18 / 7,  # every generated response, the one that failed to score too
        "val/failed_requests": 5.0,
        "val/reward_errors": 1.0,
        "val/requested_samples": 12.0,
        "val/missing_samples": 6.0,  # 12 asked for, 6 scored
        "val/a/acc": (0.5 + 1.0) / 2,
        "val/b/acc": 0.0,
        # verl's names beside ours: val-core/<data source>/acc/{mean@k, best@k/mean}, val-aux/.../reward/mean@k
        "val-core/a/acc/mean@3": (0.5 + 1.0) / 2,
        "val-core/a/acc/best@3/mean": (1.0 + 1.0) / 2,
        "val-aux/a/reward/mean@3": (0.5 + 0.5) / 2,
        "val-core/b/acc/mean@3": 0.0,
        "val-core/b/acc/best@3/mean": 0.0,
        "val-aux/b/reward/mean@3": 0.0,
    })


def test_metrics_without_any_sample_are_an_error_not_zero():
    with pytest.raises(ValidationError, match="no validation prompt has a scored sample"):
        validation_metrics(2, [], [], requested=4, failed=4)


def test_derived_timeouts_follow_the_documented_formulas(tiny_model_dir):
    cfg = config(tiny_model_dir, "data.max_response_length=1000", "actor_rollout_ref.rollout.val_kwargs.n=4",
                 "trainer.worker_timeout_s=100")
    assert validation_timeout_s(cfg, 10) == 600.0  # 0.01 s x 10 x 4 x 1000 = 400 s: the floor
    assert validation_timeout_s(cfg, 500) == pytest.approx(0.01 * 500 * 4 * 1000)
    assert finish_timeout_s(cfg, 725.0) == 2 * 100 + 725.0
    given = config(tiny_model_dir, "trainer.val_timeout_s=30", "trainer.finish_timeout_s=90")
    assert validation_timeout_s(given, 500) == 30.0 and finish_timeout_s(given, 725.0) == 90.0


# --------------------------------------------------------------------------- the Validator
class Reward:
    """Every response is right."""

    def score_group(self, token_ids, data_source, ground_truth, extra_info):
        return [RewardManagerResult(1.0, {"acc": 1.0}) for _ in token_ids]


class FirstFails(Reward):
    """The reward function fails on the first response of a group, scores the second right and the rest wrong."""

    def score_group(self, token_ids, data_source, ground_truth, extra_info):
        failed = RewardManagerResult(0.0, {"score": 0.0, "reward_error": 1.0}, "ValueError: unparsable")
        return [failed] + [RewardManagerResult(float(i == 0), {"acc": float(i == 0)}) for i in range(len(token_ids) - 1)]


def prompts(count: int) -> list:
    return [SimpleNamespace(index=i, prompt_ids=[5, 6, 7], data_source="toy", ground_truth="1", extra_info={})
            for i in range(count)]


def validator(tmp_path, engines_timeout_s: float = 30.0, k: int = 3, count: int = 4, reward=None) -> Validator:
    return Validator(prompts(count), reward or Reward(), SamplingParams(max_tokens=8, seed=1), k=k, max_num_seqs=8,
                     timeline=Timeline(str(tmp_path / "timeline.jsonl"), time.time()), timeout_s=engines_timeout_s)


def test_prompts_that_lost_different_numbers_of_samples_are_scored(tmp_path):
    """2 replicas, the second failing, k=3: prompts keep 2 or 1 of their samples (the issue's crash)."""
    engines = [FakeEngine(), FakeEngine(fail_when=lambda r: True)]
    out = asyncio.run(validator(tmp_path).run(engines, version=0))
    assert out["val/failed_requests"] == engines[1].calls == 6
    assert out["val/missing_samples"] == 6.0 and out["val/requested_samples"] == 12.0
    assert out["val/mean@3/acc"] == out["val/pass@3/acc"] == 1.0


class DiesAfter(FakeEngine):
    """Serves `served` requests, then its process is gone: every later request raises ReplicaLost."""

    def __init__(self, served: int) -> None:
        super().__init__()
        self.served, self.lost = served, 0

    async def generate(self, request):
        if self.calls >= self.served:
            self.lost += 1
            raise ReplicaLost(1, "ActorDiedError: its process died")
        return await super().generate(request)


def test_a_request_whose_replica_dies_runs_again_on_a_replica_still_serving(tmp_path):
    """2 replicas, the second dies after 2 of its 6 requests (k=3, 4 prompts): its other 4 run on the first, so every
    sample exists (a heal run on two GPUs lost 263 of 300 validation samples this way)."""
    engines = [FakeEngine(), DiesAfter(served=2)]
    out = asyncio.run(validator(tmp_path).run(engines, version=0))
    assert engines[1].calls == 2 and engines[1].lost >= 1
    assert engines[0].calls == 12 - 2
    assert out["val/missing_samples"] == 0.0 and out["val/failed_requests"] == 0.0
    assert out["val/requested_samples"] == 12.0


def test_samples_are_missing_only_when_every_replica_died(tmp_path):
    engines = [DiesAfter(served=1), DiesAfter(served=2)]
    out = asyncio.run(validator(tmp_path).run(engines, version=0))
    assert engines[0].calls + engines[1].calls == 3
    assert out["val/missing_samples"] == 9.0 and out["val/failed_requests"] == 9.0
    with pytest.raises(ValidationError, match=r"all 12 generation requests failed \(first error: .*its process died"):
        asyncio.run(validator(tmp_path).run([DiesAfter(served=0)], version=0))


def test_failed_scores_are_left_out_not_counted_as_wrong_answers(tmp_path):
    out = asyncio.run(validator(tmp_path, reward=FirstFails()).run([FakeEngine()], version=0))
    # per prompt: a failure (left out), one right, one wrong answer -> mean 1/2 (not 1/3), pass 1
    assert out["val/mean@3/acc"] == pytest.approx(0.5) and out["val/pass@3/acc"] == 1.0
    assert out["val/reward_errors"] == 4.0 and out["val/missing_samples"] == 4.0 and out["val/failed_requests"] == 0


class SlowEngine(FakeEngine):
    """Every request takes `seconds`."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def generate(self, request):
        await asyncio.sleep(self.seconds)
        return await super().generate(request)


def test_validation_keeps_the_engines_busy_once_not_once_per_request(tmp_path):
    """rollout/idle_ratio counts validation: 8 requests of 0.3 s at once are 0.3 s busy, not 2.4 s."""
    clock = BusyClock()
    check = Validator(prompts(4), Reward(), SamplingParams(max_tokens=8, seed=1), k=2, max_num_seqs=8,
                      timeline=Timeline(str(tmp_path / "timeline.jsonl"), time.time()), timeout_s=30,
                      engine_busy=clock)
    t0 = time.monotonic()
    asyncio.run(check.run([SlowEngine(0.3)], version=0))
    wall = time.monotonic() - t0
    assert clock.running == 0
    assert 0.3 <= clock.closed_s <= wall < 2.4


class HangingEngine(FakeEngine):
    """Generates nothing until aborted; records the aborted ids."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[str] = []

    async def generate(self, request):
        await asyncio.sleep(3600)

    async def abort(self, request_ids=None) -> None:
        self.aborted += list(request_ids or [])


def test_a_validation_past_its_timeout_is_aborted_and_names_the_key(tmp_path):
    engine = HangingEngine()
    with pytest.raises(ValidationError, match=r"version 7 did not finish within 0\.2 s; raise trainer\.val_timeout_s "
                                              r"\(null: max\(600 s, 0\.01 s x validation prompts"):
        asyncio.run(validator(tmp_path, engines_timeout_s=0.2, k=2, count=2).run([engine], version=7))
    assert sorted(engine.aborted) == ["val-7-0-0", "val-7-0-1", "val-7-1-0", "val-7-1-1"]


# --------------------------------------------------------------------------- the Trainer
def config(model_dir: str, *overrides: str):
    return validate(compose(overrides=[f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.n=2",
                                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.logger=[console]",
                                       *overrides]))


class Remote:
    """`handle.method.remote(*args)` returns a ref; the patched ray.get calls it with its timeout."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def __getattr__(self, name):
        method = getattr(self._obj, name)
        return SimpleNamespace(remote=lambda *args: (lambda timeout: method(*args, timeout=timeout)
                                                     if name == "validate" else method(*args)))


class Side:
    """The Rollouter, the queue and the worker group in one: records what was called, in order."""

    def __init__(self, validation=None) -> None:
        self.calls: list[str] = []
        self.waits: list[float] = []
        self.validation = validation  # an exception to raise, or None

    def validate(self, version, timeout):
        self.calls.append("validate")
        self.waits.append(timeout)
        if self.validation is not None:
            raise self.validation
        return {"val/mean@1/acc": 0.5}

    def validation_timeout_s(self):
        return 5.0

    def state_dict(self):
        return {"iterator": {}}

    def snapshot(self):
        return []

    def checkpointed(self, path):  # the queue's mark that a trainer restart rewinds to (healing/trainer.py)
        pass

    def save_checkpoint(self, root, extra, step, info=None):  # info: run_info.json (config/resume.py)
        self.calls.append(f"save {step}")


@pytest.fixture
def trainer(monkeypatch, tmp_path, tiny_model_dir):
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref(timeout))

    def build(side: Side, *overrides: str) -> Trainer:
        cfg = config(tiny_model_dir, f"trainer.default_local_dir={tmp_path / 'run'}", *overrides)
        t = Trainer(cfg, None, None, run_dir=str(tmp_path), run_start=time.time(), pad_token_id=0, worker_group=side)
        t.rollouter, t.queue = Remote(side), Remote(side)
        return t

    return build


def test_checkpoint_first_then_a_failing_validation_is_logged_and_training_goes_on(trainer, caplog):
    side = Side(validation=RuntimeError("the scorer exploded"))
    t = trainer(side, "trainer.save_freq=1", "trainer.test_freq=1", "trainer.val_async=false")  # validates paused
    t.version = 1
    out = t._while_paused()
    assert side.calls == ["save 1", "validate"] and "timing_s/save_checkpoint" in out
    assert t.val_failures == [{"version": 1, "error": "RuntimeError: the scorer exploded"}]
    assert "validation at version 1 failed, training goes on: RuntimeError: the scorer exploded" in caplog.text
    assert t.summary()["validation_failures"] == t.val_failures


def test_a_validation_that_does_not_answer_in_time_names_the_key(trainer):
    side = Side(validation=ray.exceptions.GetTimeoutError("Get timed out"))
    t = trainer(side, "trainer.test_freq=1")
    t.version = 2
    assert t.validate() == {}
    assert side.waits == [5.0 + VALIDATION_GRACE_S]  # the Rollouter's own timeout fires first
    assert t.val_failures[0]["error"] == (f"the Rollouter did not answer within {5.0 + VALIDATION_GRACE_S:.0f} s; "
                                          "raise trainer.val_timeout_s")


def test_a_reward_function_that_fails_too_often_stops_the_run_also_in_validation(trainer):
    t = trainer(Side(validation=RewardFunctionError("reward function f failed on 3 of the last 3")), "trainer.test_freq=1")
    with pytest.raises(RewardFunctionError, match="failed on 3 of the last 3"):
        t.validate()
    assert t.val_failures == []


@pytest.mark.parametrize("test_freq", [-1, 0])
def test_test_freq_off_means_no_validation_at_the_end_but_the_checkpoint(trainer, test_freq):
    side = Side()
    t = trainer(side, "trainer.save_freq=5", f"trainer.test_freq={test_freq}", "trainer.val_before_train=false")
    t.version, t.step = 2, 4  # step % trigger_parameter_sync_step (2) == 0: the weights are on the engines
    assert t.finish() == {}
    assert side.calls == ["save 2"]
    assert t.timeouts()["finish_s"] == 2 * 1800.0  # no final validation: nothing of its timeout
    # the validation before training runs beside training (val_async): the end may still wait for it, once
    with_before = trainer(Side(), f"trainer.test_freq={test_freq}", "trainer.val_before_train=true")
    assert with_before.timeouts()["finish_s"] == 2 * 1800.0 + 5.0 + VALIDATION_GRACE_S


@pytest.mark.parametrize("val_async, validations", [(True, 2), (False, 1)])  # async: one may still run at the end
def test_the_end_of_a_run_checkpoints_before_it_validates(trainer, val_async, validations):
    side = Side()
    t = trainer(side, "trainer.save_freq=5", "trainer.test_freq=3", f"trainer.val_async={str(val_async).lower()}")
    t.version, t.step = 2, 4
    assert t.finish() == {"val/mean@1/acc": 0.5}
    assert side.calls == ["save 2", "validate"]
    assert t.timeouts()["finish_s"] == 2 * 1800.0 + validations * (5.0 + VALIDATION_GRACE_S)
