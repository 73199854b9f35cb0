"""On-policy distillation end to end on CPU (real Ray, tiny models): the teacher scores every sampled token on the
rollout side, the trainer's distillation loss pulls the student towards it."""

from __future__ import annotations

import json

import pytest

from verl_async.config import compose, validate
from verl_async.data import builtin, write_rows
from verl_async.models.tiny import build_tiny_model_dir
from verl_async.pipeline import run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    write_rows(builtin.generate_rows("train", 64, seed=3), str(folder / "train.parquet"))
    return str(folder / "train.parquet")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return build_tiny_model_dir(str(tmp_path_factory.mktemp("teacher")), seed=1)  # same tokenizer, other weights


def _metrics(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line)["data"] for line in f if line.strip()]


def distill_overrides(tmp_path, student, teacher, data, *extra):
    return [
        f"actor_rollout_ref.model.path={student}", f"data.train_files={data}", "data.val_files=null",
        "data.max_prompt_length=64", "data.max_response_length=12", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.max_num_seqs=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.optim.lr=3e-3", "trainer.total_training_steps=8", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.logger=[file]", f"trainer.default_local_dir={tmp_path / 'run'}",
        "ray_init.num_cpus=4", "distillation.enabled=true",
        f"distillation.teacher_models.teacher_model.model_path={teacher}",
        "distillation.distillation_loss.use_task_rewards=false", *extra]


def test_student_moves_towards_the_teacher(ray_session, tmp_path, tiny_model_dir, teacher_dir, data_files):
    extra = ["distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=8"]
    cfg = validate(compose(overrides=distill_overrides(tmp_path, tiny_model_dir, teacher_dir, data_files, *extra)))
    summary = run(cfg)
    assert summary["trainer/steps"] == 8
    rows = [m for m in _metrics(tmp_path / "run") if "distillation/loss" in m]
    assert len(rows) == 8
    losses = [r["distillation/loss"] for r in rows]
    assert sum(losses[-2:]) < 0.6 * sum(losses[:2]), losses  # the student learned the teacher's top-k
    # its mass on the teacher's top-k grows towards the teacher's
    assert rows[-1]["distillation/student_mass"] > rows[0]["distillation/student_mass"]
    assert 0 < rows[-1]["distillation/teacher_mass"] <= 1.0 + 1e-4
    assert rows[-1]["distillation/teacher_scored_responses"] >= 8 * 2 * 2  # every trained response was scored
    # use_task_rewards=false: the distillation loss is the whole loss (verl's distillation_ppo_loss)
    assert all(r["actor/loss"] == pytest.approx(r["distillation/loss"]) for r in rows)


def test_verls_opd_settings_train_with_task_rewards(ray_session, tmp_path, tiny_model_dir, teacher_dir, data_files):
    """verl's OPD e2e loss (k1 as a policy-gradient advantage, clamps), here beside the task reward."""
    extra = ["distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=true",
             "distillation.distillation_loss.loss_max_clamp=10.0", "distillation.distillation_loss.log_prob_min_clamp=-10",
             "distillation.distillation_loss.use_task_rewards=true", "distillation.distillation_loss.distillation_loss_coef=0.5",
             "trainer.total_training_steps=4"]
    cfg = validate(compose(overrides=distill_overrides(tmp_path, tiny_model_dir, teacher_dir, data_files, *extra)))
    assert run(cfg)["trainer/steps"] == 4
    rows = [m for m in _metrics(tmp_path / "run") if "distillation/loss" in m]
    assert len(rows) == 4
    for r in rows:  # loss = policy loss + 0.5 x distillation (verl's distillation_ppo_loss with task rewards)
        assert r["actor/loss"] == pytest.approx(r["actor/pg_loss"] + 0.5 * r["distillation/loss"], abs=1e-5)
        assert r["distillation/abs_loss"] > 0
