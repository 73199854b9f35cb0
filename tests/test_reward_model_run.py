"""A reward model in a real CPU run (Ray, tiny models): a random classifier beside the engine scores every response
with the rule reward added; a judge (the tiny model, served by a native engine of its own) whose unparsable answers
are counted without stopping the run."""

from __future__ import annotations

import json

import pytest

from tests.test_verl_v1_scripts import make_classifier
from verl_async.config import compose, validate
from verl_async.data import builtin, write_rows
from verl_async.pipeline import run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    write_rows(builtin.generate_rows("train", 32, seed=3), str(folder / "train.parquet"))
    return str(folder / "train.parquet")


def _rows(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line)["data"] for line in f if line.strip()]


def _overrides(tmp_path, model, data, *extra):
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", "data.val_files=null",
            "data.max_prompt_length=64", "data.max_response_length=12", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.max_num_seqs=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.total_training_steps=4", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.logger=[file]", f"trainer.default_local_dir={tmp_path / 'run'}", "ray_init.num_cpus=4",
            "reward.reward_model.enable=true", *extra]


def test_discriminative_reward_model_with_the_rule_reward(ray_session, tmp_path, tiny_model_dir, data_file):
    rm = make_classifier(tmp_path / "rm", tiny_model_dir)
    cfg = validate(compose(overrides=_overrides(
        tmp_path, tiny_model_dir, data_file, f"reward.reward_model.model_path={rm}",
        "reward.reward_model.use_task_rewards=true", "reward.reward_model.reward_model_coef=0.5",
        "reward.reward_model.rollout.max_num_seqs=16")))
    summary = run(cfg)
    assert summary["trainer/steps"] == 4
    rows = _rows(tmp_path / "run")
    last = rows[-1]
    assert last["reward/rm_scored"] >= 4 * 2 * 2 and last["reward/rm_errors"] == 0
    assert all(r["critic/score/mean"] != 0.0 for r in rows)  # the model's scores are never exactly 0


def test_a_judge_served_by_the_native_engine_counts_what_it_cannot_parse(ray_session, tmp_path, tiny_model_dir,
                                                                          data_file):
    cfg = validate(compose(overrides=_overrides(
        tmp_path, tiny_model_dir, data_file, f"reward.reward_model.model_path={tiny_model_dir}",
        "reward.reward_model.rollout.response_length=6", "reward.reward_model.rollout.temperature=1.0",
        "reward.reward_model.rollout.prompt_length=400", "reward_model.max_error_rate=1.0")))
    summary = run(cfg)
    assert summary["trainer/steps"] == 4
    last = _rows(tmp_path / "run")[-1]
    # a random model rarely writes a number: every answer was asked for and counted, none stopped the run
    assert last["reward/rm_scored"] >= 4 * 2 * 2
    assert 0 < last["reward/rm_errors"] <= last["reward/rm_scored"]
    assert last["reward/scorer_errors"] == last["reward/rm_errors"]  # in the reward manager's books
