"""RolloutService without Ray (fake engines in-process): validation over failed requests, its seeds, resume state."""

import asyncio
import time
from dataclasses import asdict

import pytest

from tests.fakes import FakeEngine
from verl_async.config import compose, validate
from verl_async.data import builtin, write_rows
from verl_async.rollout.rollouter import PromptTask
from verl_async.rollout.service import RolloutService
from verl_async.rollout.validation import ValidationError

K = 4


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rows = builtin.generate_rows("train", 8, seed=3)
    val = builtin.generate_rows("val", 3, seed=4, exclude={r["prompt"][0]["content"] for r in rows})
    write_rows(rows, str(folder / "train.parquet"))
    write_rows(val, str(folder / "val.parquet"))
    return str(folder / "train.parquet"), str(folder / "val.parquet")


@pytest.fixture
def service():
    made = []

    def build(tmp_path, model_dir, files, engines, *extra: str) -> RolloutService:
        made.append(_service(tmp_path, model_dir, files, engines, *extra))
        return made[-1]

    yield build
    for svc in made:
        svc.reward.close()


def _service(tmp_path, model_dir, files, engines, *extra: str) -> RolloutService:
    train, val = files
    cfg = validate(compose(overrides=[
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={train}", f"data.val_files={val}",
        "data.max_prompt_length=64", "data.max_response_length=12", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", f"trainer.default_local_dir={tmp_path / 'run'}",
        f"actor_rollout_ref.rollout.val_kwargs.n={K}", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", *extra,
    ]))
    return RolloutService(cfg, None, model_path=model_dir, run_dir=str(tmp_path / "run"), run_start=time.time(),
                          engines=engines)


def test_validation_samples_of_a_prompt_get_their_own_seeds(service, tmp_path, tiny_model_dir, data_files):
    engine = FakeEngine(seeded=True)
    svc = service(tmp_path, tiny_model_dir, data_files, [engine])
    out = asyncio.run(svc.validate(0))
    assert engine.calls == 3 * K
    for p in range(3):
        seeds = engine.seeds[p * K:(p + 1) * K]
        assert len(set(seeds)) == K, seeds  # one seed per prompt made the k samples identical
    assert out["val/failed_requests"] == 0.0


def test_validation_scores_only_responses_that_exist(service, tmp_path, tiny_model_dir, data_files):
    broken = FakeEngine(fail_when=lambda r: True, error="CUDA error: device-side assert")
    svc = service(tmp_path, tiny_model_dir, data_files, [broken, FakeEngine(max_len=5)])
    out = asyncio.run(svc.validate(0))
    assert out["val/failed_requests"] == broken.calls == 3 * K // 2
    assert 1.0 <= out["val/response_length/mean"] <= 5.0  # failed (empty) responses are not averaged in


def test_validation_without_any_response_raises(service, tmp_path, tiny_model_dir, data_files):
    engines = [FakeEngine(fail_when=lambda r: True, error="CUDA error: device-side assert")]
    svc = service(tmp_path, tiny_model_dir, data_files, engines)
    with pytest.raises(ValidationError, match=r"all 12 generation requests failed.*device-side assert"):
        asyncio.run(svc.validate(0))


def test_prompts_pushed_back_by_a_resume_stay_in_the_state(service, tmp_path, tiny_model_dir, data_files):
    """A second crash before the re-queued prompts start must not lose them."""
    svc = service(tmp_path, tiny_model_dir, data_files, [FakeEngine()])
    state = svc.state_dict()
    pending = [PromptTask(f"0:{i}", i, 0, [1, 2, 3]) for i in (5, 6)]
    state.update(pending=[asdict(t) for t in pending], started_groups=7)
    assert svc.load_state_dict(state, queued_uids=["0:6"]) == 1
    again = svc.state_dict()
    assert [p["uid"] for p in again["pending"]] == ["0:5"] and again["started_groups"] == 7
    fresh = service(tmp_path, tiny_model_dir, data_files, [FakeEngine()])
    assert fresh.load_state_dict(again) == 1
    assert fresh.rollouter.counters.started_groups == 6 and fresh.source.next().uid == "0:5"
