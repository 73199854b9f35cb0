"""True on-policy mode end to end on CPU: `python -m recipe.fully_async_main ... true_on_policy=true`.

On-policy settings (staleness 0, a sync after every step, recomputed old log-probs): every token the
trainer sees was sampled by the weights it recomputes with, in another process (the engine's Ray
replica) with another thread count. With the mode on, the recomputed log-probs equal the rollout's at
every step (`mismatch/train_rollout_logprob_abs_diff_max` is 0.0) and the first mini-batch's PPO ratio
is exactly 1 (`actor/first_minibatch_ratio_dev_max` 0.0: the training forward reproduces the no-grad
one). The weights move between versions (AdamW's weight decay at least) and reach the engine after
every step. The same run with the mode off shows a nonzero gap, so the metrics are not vacuous. The
run is started without the mode's BLAS environment (CPU needs none: its sums are exact), as a process of its
own; the other two runs call the command in the test process on the session's Ray (tests/entry_point.py).

Fully async, in issue 41's shape (n=3, max_num_seqs=5, mini-batches of 3, a 700-token micro-batch
budget, a sync every 2 steps, rollout correction with rejection on): every token of the trainer's
version equals its recomputation, its correction weight is exactly 1 and none is rejected; the
second step of each sync window recomputes with weights one update past every token's version, so
none is of its version there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.entry_point import run_main
from verl_async.data import builtin, write_rows
from verl_async.invariant import PROCESS_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    write_rows(builtin.generate_rows("train", 4 * STEPS, seed=3), str(path))
    return str(path)


ON_POLICY = ["async_training.staleness_threshold=0", "async_training.partial_rollout=false",
             "async_training.trigger_parameter_sync_step=1"]


FULLY_ASYNC = ["async_training.staleness_threshold=0.5", "async_training.partial_rollout=true",
               "async_training.trigger_parameter_sync_step=2", "actor_rollout_ref.rollout.n=3",
               "actor_rollout_ref.rollout.max_num_seqs=5", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
               "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=700",
               "actor_rollout_ref.actor.rollout_correction.enable=true", "actor_rollout_ref.actor.rollout_correction.rs=true",
               f"rollout.total_rollout_steps={4 * STEPS}"]


def run_metrics(tmp_path, model_dir: str, train_file: str, on: bool, schedule: list[str] = ON_POLICY,
                steps: int = STEPS, own_process: bool = False) -> list[dict]:
    """The command's metrics per step. `own_process`: a fresh interpreter with a Ray of its own, as a user starts it
    (the pipeline hands its workers the mode's environment); else the command runs in this process on the test
    session's Ray (tests/entry_point.py: the same run without an interpreter and a Ray start of its own)."""
    run_dir = tmp_path / "run"
    base = [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={train_file}", "data.val_files=null",
        "data.max_prompt_length=64", "data.max_response_length=12",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.temperature=0.9",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.optim.lr=1e-3", f"rollout.total_rollout_steps={2 * STEPS}",
        "async_training.use_rollout_log_probs=false",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[file]",
        f"trainer.default_local_dir={run_dir}", f"hydra.run.dir={tmp_path / 'hydra'}", "ray_init.num_cpus=4",
        f"actor_rollout_ref.rollout.true_on_policy={str(on).lower()}",
    ]
    overrides = {o.split("=", 1)[0]: o for o in [*base, *schedule]}  # the schedule's value of a key wins
    env = {k: v for k, v in os.environ.items() if k not in PROCESS_ENV}
    if own_process:
        cmd = [sys.executable, "-m", "recipe.fully_async_main", *overrides.values()]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=840,
                              env={**env, "PYTHONUNBUFFERED": "1"})
    else:
        proc = run_main(list(overrides.values()), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        lines = [json.loads(line)["data"] for line in f if line.strip()]
    logged = [m for m in lines if "mismatch/train_rollout_logprob_abs_diff_max" in m]
    assert len(logged) == steps, f"{len(logged)} trainer steps logged, expected {steps}"
    return logged


def test_rollout_and_recomputed_log_probs_are_equal_at_every_step(tmp_path, tiny_model_dir, train_file):
    for m in run_metrics(tmp_path, tiny_model_dir, train_file, on=True, own_process=True):
        assert m["mismatch/train_rollout_logprob_abs_diff_max"] == 0.0, m
        assert m["actor/first_minibatch_ratio_dev_max"] == 0.0, m


def test_with_the_mode_off_the_same_run_shows_a_gap(ray_session, tmp_path, tiny_model_dir, train_file):
    steps = run_metrics(tmp_path, tiny_model_dir, train_file, on=False)
    assert max(m["mismatch/train_rollout_logprob_abs_diff_max"] for m in steps) > 0.0


def test_fully_async_tokens_of_the_trainers_version_are_equal(ray_session, tmp_path, tiny_model_dir, train_file):
    steps = run_metrics(tmp_path, tiny_model_dir, train_file, on=True, schedule=FULLY_ASYNC, steps=4 * STEPS // 3)
    measured = [m for m in steps if "mismatch/same_version_logprob_abs_diff_max" in m]
    assert measured, "no step trained on a token of its own version"
    for m in measured:
        assert m["mismatch/same_version_logprob_abs_diff_max"] == 0.0, m
        assert m["mismatch/same_version_weight_dev_max"] == 0.0, m
        assert m["mismatch/same_version_rejected_frac"] == 0.0, m
    assert all(m["actor/first_minibatch_ratio_dev_max"] == 0.0 for m in steps)
    # steps 2 and 4 of the run follow a local update: no token can be of the trainer's weights
    assert [m["mismatch/same_version_token_frac"] for m in steps][1::2] == [0.0] * (len(steps) // 2)
