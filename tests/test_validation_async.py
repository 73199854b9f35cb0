"""Validation beside training (trainer.val_async, issue 27 item 5).

A validation starts after the sync that made its version, runs on the engines beside the
training rollouts, is never aborted by a sync (its responses stay on one version), and its
metrics land at the step of that version whenever they arrive; the trainer does not wait for it
until the next sync, which settles it before any weight moves.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import ray

from tests.fakes import FakeEngine, ListSink, ListSource, no_score
from verl_async.config import compose, validate
from verl_async.reward import RewardFunctionError
from verl_async.reward.manager import Reward as RewardManagerResult
from verl_async.rollout.background_validation import BackgroundValidation
from verl_async.rollout.engine import SamplingParams
from verl_async.rollout.rollouter import PromptTask, Rollouter
from verl_async.rollout.validation import ValidationError, Validator
from verl_async.staleness import StalenessBudget
from verl_async.sync.driver import SyncDriver
from verl_async.trainer.trainer import Trainer
from verl_async.trainer.validation_handover import restart_validations
from verl_async.utils.timeline import Timeline


# --------------------------------------------------------------------------- BackgroundValidation
def test_outcomes_carry_their_version_and_a_failure_is_an_outcome():
    async def main():
        gate = asyncio.Event()

        async def run(version):
            await gate.wait()
            if version == 2:
                raise ValidationError("validation at version 2: all 4 generation requests failed")
            if version == 3:
                raise RewardFunctionError("reward function f failed on 21 of the last 200")
            return {"val/mean@1/acc": version / 10}

        bg = BackgroundValidation(run)
        bg.start(1)
        await asyncio.sleep(0.01)
        assert bg.take() == [] and bg.running_version == 1  # still running: nothing to log yet
        with pytest.raises(RuntimeError, match="version 5 started while version 1 still runs"):
            bg.start(5)
        gate.set()
        [first] = await bg.settle()
        assert (first.version, first.metrics, first.error, first.fatal) == (1, {"val/mean@1/acc": 0.1}, None, False)
        bg.start(2)
        [failed] = await bg.settle()
        assert failed.error.startswith("ValidationError: validation at version 2") and not failed.fatal
        bg.start(3)
        [fatal] = await bg.settle()
        assert fatal.fatal and fatal.version == 3
        gate.clear()
        bg.start(4)
        assert await bg.cancel() == 4  # the caller reports it: no outcome
        assert bg.running_version is None and bg.take() == [] and await bg.cancel() is None

    asyncio.run(main())


# --------------------------------------------------------------------------- on the engines, beside the Rollouter
class SlowValidationEngine(FakeEngine):
    """Validation requests (`val-...`) produce nothing until `release` is set; records every abort."""

    def __init__(self) -> None:
        super().__init__(max_len=6, token_delay=0.001)
        self.release = asyncio.Event()
        self.aborts: list = []  # the ids of each abort call (None: all)

    async def generate(self, request):
        if request.request_id.startswith("val-"):
            await self.release.wait()
        return await super().generate(request)

    async def abort(self, request_ids=None) -> None:
        self.aborts.append(None if request_ids is None else list(request_ids))
        await super().abort(request_ids)


class RightAnswers:
    def score_group(self, token_ids, data_source, ground_truth, extra_info):
        return [RewardManagerResult(1.0, {"acc": 1.0}) for _ in token_ids]


def test_a_slow_validation_runs_beside_generation_and_a_sync_does_not_abort_it(tmp_path):
    """Groups keep coming while the validation generates nothing; the sync's abort leaves the validation's
    requests alone, and they finish whole, on the version they started on."""

    async def main():
        engine = SlowValidationEngine()
        sink = ListSink()
        tasks = [PromptTask(f"e0-i{i}", i, 0, [1, 2, 3]) for i in range(40)]
        ro = Rollouter(engines=[engine], prompts=ListSource(tasks), scorer=no_score, sink=sink, n=2,
                       sampling=SamplingParams(max_tokens=6, seed=0), budget=StalenessBudget(1000),
                       partial_rollout=True, max_inflight_groups=4)
        val_items = [SimpleNamespace(index=i, prompt_ids=[5, 6], data_source="toy", ground_truth="1", extra_info={})
                     for i in range(3)]
        validator = Validator(val_items, RightAnswers(), SamplingParams(max_tokens=6, seed=1), k=2, max_num_seqs=8,
                              timeline=Timeline(str(tmp_path / "timeline.jsonl"), time.time()), timeout_s=30)
        bg = BackgroundValidation(lambda version: validator.run([engine], version))
        run = asyncio.create_task(ro.run())
        bg.start(0)
        for _ in range(500):  # the validation holds 6 requests on the engine and produces nothing meanwhile
            if len(sink.groups) >= 5:
                break
            await asyncio.sleep(0.01)
        assert len(sink.groups) >= 5 and bg.running_version == 0 and bg.take() == []
        await ro.pause_for_sync()  # partial rollout: aborts the training requests in flight, not the validation's
        assert engine.aborts and None not in engine.aborts
        assert not any(rid.startswith("val-") for ids in engine.aborts for rid in ids)
        engine.release.set()
        [outcome] = await asyncio.wait_for(bg.settle(), 10)
        assert outcome.version == 0 and outcome.error is None
        assert outcome.metrics["val/failed_requests"] == 0.0 and outcome.metrics["val/missing_samples"] == 0.0
        assert outcome.metrics["val/mean@2/acc"] == 1.0
        await engine.update_weights([], 1)
        await ro.resume_after_sync(1)
        await asyncio.wait_for(run, 30)
        assert len(sink.groups) == 40

    asyncio.run(main())


def test_an_aborted_validation_response_is_missing_not_scored(tmp_path):
    """An aborted response is cut short: scoring it would count a truncated answer as a wrong one."""

    class AbortsFirst(FakeEngine):
        async def generate(self, request):
            result = await super().generate(request)
            if request.request_id.endswith("-0-0"):
                result.finish_reason = "abort"
            return result

    items = [SimpleNamespace(index=i, prompt_ids=[5], data_source="toy", ground_truth="1", extra_info={}) for i in range(2)]
    validator = Validator(items, RightAnswers(), SamplingParams(max_tokens=4, seed=1), k=2, max_num_seqs=4,
                          timeline=Timeline(None, time.time()), timeout_s=30)
    out = asyncio.run(validator.run([AbortsFirst()], version=3))
    assert out["val/failed_requests"] == 1.0 and out["val/missing_samples"] == 1.0


# --------------------------------------------------------------------------- the Trainer's side
class FakeRollouter:
    """The Rollouter's validation calls, in-process; `finish()` ends the running validation."""

    def __init__(self, settle_hangs: bool = False) -> None:
        self.calls: list[str] = []
        self.running = None
        self.done: list[dict] = []
        self.settle_hangs = settle_hangs

    def finish(self, metrics=None, error=None, fatal=False):
        self.done.append({"version": self.running, "metrics": metrics, "error": error, "fatal": fatal, "seconds": 1.0})
        self.running = None

    def pause_for_sync(self):
        self.calls.append("pause")

    def resume_after_sync(self, version):
        self.calls.append(f"resume {version}")

    def start_validation(self, version):
        self.calls.append(f"start {version}")
        self.running = version
        return True

    def take_validations(self):
        out, self.done = self.done, []
        return out

    def settle_validation(self):
        self.calls.append("settle")
        if self.settle_hangs:
            raise ray.exceptions.GetTimeoutError("Get timed out")
        if self.running is not None:
            self.finish({"val/mean@1/acc": 0.25})
        return self.take_validations()

    def cancel_validation(self):
        self.calls.append("cancel")

    def validation_timeout_s(self):
        return 5.0


class Remote:
    """`handle.method.remote(*args)` -> a ref that the patched ray.get calls."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def __getattr__(self, name):
        return SimpleNamespace(remote=lambda *args, **kw: (lambda timeout=None: getattr(self._obj, name)(*args, **kw)))


class RecordingSync(SyncDriver):
    """The real SyncDriver.push with in-process waits; transfer records where it ran."""

    family = "test"

    def __init__(self, rollouter: FakeRollouter) -> None:
        super().__init__(None, Remote(rollouter), bucket_bytes=1)
        self.side = rollouter

    def wait(self, refs, what):
        return {name: ref() for name, ref in refs.items()}

    def transfer(self, version):
        self.side.calls.append(f"transfer {version}")
        return {"sync/buckets": 1.0}

    def check_coverage(self, version):
        pass


def made(t: Trainer, version: int) -> None:
    """Trainer step `version` made weight version `version` (trigger_parameter_sync_step=1): metrics go by step."""
    t.step = t.version = version
    t._version_step[version] = version


@pytest.fixture
def trainer(monkeypatch, tmp_path, tiny_model_dir):
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref(timeout))

    def build(side: FakeRollouter, *overrides: str) -> tuple[Trainer, list]:
        cfg = validate(compose(overrides=[
            f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.logger=[console]",
            "async_training.trigger_parameter_sync_step=1", f"trainer.default_local_dir={tmp_path / 'run'}",
            *overrides]))
        t = Trainer(cfg, None, None, run_dir=str(tmp_path), run_start=time.time(), pad_token_id=0)
        t.rollouter, t.sync = Remote(side), RecordingSync(side)
        logged: list = []
        monkeypatch.setattr(t.tracker, "log", lambda metrics, step: logged.append((step, dict(metrics))))
        return t, logged

    return build


def test_the_trainer_goes_on_while_a_validation_runs_and_its_metrics_land_at_its_version(trainer):
    side = FakeRollouter()
    t, logged = trainer(side, "trainer.test_freq=2")
    made(t, 2)
    t.push_weights()
    assert side.calls == ["pause", "transfer 2", "resume 2", "start 2"]  # started once generation resumed
    made(t, 3)  # a step trained meanwhile: nothing waited for the validation
    t.collect_validations()
    assert logged == [] and t.val_history == []
    side.finish({"val/mean@1/acc": 0.5})  # it finishes while version 3 is being trained
    t.collect_validations()
    assert logged == [(2, {"val/mean@1/acc": 0.5})] and t.val_history == [{"version": 2, "val/mean@1/acc": 0.5}]
    side.calls.clear()
    out = t.push_weights()  # version 3: nothing to settle, not due (test_freq=2)
    assert side.calls == ["pause", "transfer 3", "resume 3"] and "timing_s/sync_wait_validation" not in out


def test_the_next_sync_waits_for_a_validation_still_running_before_moving_weights(trainer):
    side = FakeRollouter()
    t, logged = trainer(side, "trainer.test_freq=1")
    made(t, 1)
    t.push_weights()
    side.calls.clear()
    made(t, 2)
    out = t.push_weights()
    assert side.calls == ["pause", "settle", "transfer 2", "resume 2", "start 2"]
    assert "timing_s/sync_wait_validation" in out and logged == [(1, {"val/mean@1/acc": 0.25})]
    t.finish()  # the end of the run waits for version 2's before its summary
    assert [step for step, _ in logged] == [1, 2] and side.calls[-1] == "settle"
    assert [v["version"] for v in t.summary()["validation"]] == [1, 2]


def test_a_failed_validation_is_logged_at_its_version_and_a_broken_reward_function_stops_the_run(trainer, caplog):
    side = FakeRollouter()
    t, logged = trainer(side, "trainer.test_freq=1")
    made(t, 4)
    t.push_weights()
    side.finish(error="ValidationError: validation at version 4 did not finish within 0.2 s")
    made(t, 5)
    t.collect_validations()
    assert t.val_failures == [{"version": 4, "error": "ValidationError: validation at version 4 did not finish "
                                                       "within 0.2 s"}] and logged == []
    assert "validation at version 4 failed, training goes on" in caplog.text
    t.push_weights()
    side.finish(error="RewardFunctionError: reward function f failed on 21 of the last 200", fatal=True)
    with pytest.raises(RewardFunctionError, match=r"^reward function f failed on 21 of the last 200$"):
        t.collect_validations()


def test_a_validation_the_rollouter_does_not_settle_in_time_is_cancelled_and_counted(trainer):
    side = FakeRollouter(settle_hangs=True)
    t, _ = trainer(side, "trainer.test_freq=1")
    made(t, 1)
    t.push_weights()
    made(t, 2)
    t.push_weights()
    assert side.calls[:6] == ["pause", "transfer 1", "resume 1", "start 1", "pause", "settle"]
    assert side.calls[6:8] == ["cancel", "transfer 2"]  # cancelled before any weight moved
    assert t.val_failures[0]["version"] == 1 and "raise trainer.val_timeout_s" in t.val_failures[0]["error"]


def test_val_async_false_keeps_the_validation_inside_the_sync(trainer):
    side = FakeRollouter()
    t, _ = trainer(side, "trainer.test_freq=1", "trainer.val_async=false")
    validated = []
    t.validate = lambda: validated.append(t.version) or {}
    made(t, 1)
    t.push_weights()
    assert side.calls == ["pause", "transfer 1", "resume 1"] and validated == [1]


def test_the_validation_before_training_runs_beside_it_and_says_so_when_it_ends(trainer, capsys):
    """Start-up (issue 37): with val_async the run trains at once instead of waiting for it; the first sync waits
    for what is left of it; its console line comes when it ends; the end of the run waits for it (finish's timeout
    counts it even with test_freq=-1)."""
    side = FakeRollouter()
    t, logged = trainer(side, "trainer.test_freq=-1", "trainer.val_before_train=true")
    assert t.timeouts()["finish_s"] >= t.timeouts()["validation_s"]
    assert t.start_validation_before_training() is True and side.calls == ["start 0"]
    made(t, 1)  # a step trained while it ran
    t.collect_validations()
    assert logged == [] and "validation before training" not in capsys.readouterr().out
    t.push_weights()  # the first sync settles it before any weight moves; its metrics land at version 0's step
    assert side.calls == ["start 0", "pause", "settle", "transfer 1", "resume 1"]
    assert logged == [(0, {"val/mean@1/acc": 0.25})] and t.summary()["val_before"] == {"val/mean@1/acc": 0.25}
    assert "validation before training (version 0): val/mean@1/acc=0.250" in capsys.readouterr().out

    side, lines = FakeRollouter(), []
    t, logged = trainer(side, "trainer.test_freq=-1", "trainer.val_before_train=true")
    t._say = lines.append  # the TrainerHost's console sink: the driver prints these lines
    t.start_validation_before_training()
    side.finish(error="ValidationError: validation at version 0: all 4 generation requests failed")
    t.collect_validations()
    assert lines == ["warning: the validation before training (version 0) failed, training goes on: "
                     "ValidationError: validation at version 0: all 4 generation requests failed"]
    assert t.summary()["val_before"] == {} and t.val_failures[0]["version"] == 0
    side.running = None
    side.start_validation = lambda version: False  # no data.val_files: nothing starts
    assert t.start_validation_before_training() is False


# --------------------------------------------------------------------------- across a trainer restart
def outcome(version: int, acc: float) -> dict:
    return {"version": version, "metrics": {"val/mean@1/acc": acc}, "error": None, "fatal": False, "seconds": 1.0}


def test_a_restart_keeps_the_validations_of_kept_versions_and_reruns_the_one_that_died_with_the_trainer():
    left = [outcome(8, 0.1), outcome(12, 0.2)]
    # restored at version 8: version 12's weights are gone (validated again when the run gets there)
    assert restart_validations(None, left, 8, due=True) == ([outcome(8, 0.1)], False)
    # cancelled at the restored version, due there: it runs again; not due (test_freq): it does not
    assert restart_validations(16, [], 16, due=True) == ([], True)
    assert restart_validations(16, [], 16, due=False) == ([], False)
    # cancelled at a version after the checkpoint: it comes again with that version
    assert restart_validations(20, left, 16, due=True) == (left, False)


def test_the_restarted_trainer_logs_what_the_dead_one_left_and_validates_its_version_again(trainer):
    side = FakeRollouter()
    t, logged = trainer(side, "trainer.test_freq=4")
    made(t, 16)  # restored from the checkpoint of version 16; its validation finished, the dead trainer never took it
    t.resume_validations(None, [outcome(16, 0.2), outcome(20, 0.9)])
    assert logged == [(16, {"val/mean@1/acc": 0.2})] and side.calls == []  # version 20's weights died with it
    logged.clear()
    t.resume_validations(16, [])  # this time version 16's validation was cancelled with the death: it runs again
    assert side.calls == ["start 16"]
    side.finish({"val/mean@1/acc": 0.3})
    t.collect_validations()
    assert logged == [(16, {"val/mean@1/acc": 0.3})]
    side, logged = FakeRollouter(), None
    t, logged = trainer(side, "trainer.test_freq=4", "trainer.val_before_train=true")
    made(t, 3)  # restored at version 3 (not due: test_freq=4), whose validation before training died with the trainer
    t.resume_validations(3, [])
    assert side.calls == ["start 3"]
