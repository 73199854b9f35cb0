"""`python -m recipe.fully_async_main` on CPU with engine replicas that fail every request.

debug.fail_replicas (verl_async/rollout/faults.py) makes replicas answer every
request with an error. Every replica failing must end the run with the engine's error
and exit 1 by itself, well before any hang guard (a GPU run once sat at 0 steps for minutes and printed a
validation accuracy of 0.000 for responses that never existed); one failing replica
must be taken out of rotation while the other trains every prompt; a validation that
lost some samples reports them and neither stops the run nor costs its checkpoint.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import time

import pytest

from tests.entry_point import run_main
from verl_async.data import builtin, write_rows

pytestmark = pytest.mark.slow
STOP_WITHIN_S = 180  # a hang guard, not a speed target: ~35 s on 2 idle cores, 80-100 s at load 15-20


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rows = builtin.generate_rows("train", 8, seed=3)
    val = builtin.generate_rows("val", 4, seed=4, exclude={r["prompt"][0]["content"] for r in rows})
    write_rows(rows, str(folder / "train.parquet"))
    write_rows(val, str(folder / "val.parquet"))
    return str(folder / "train.parquet"), str(folder / "val.parquet")


def run_failing(tmp_path, model_dir, data_files, fail: str, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    train, val = data_files
    args = [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={train}", f"data.val_files={val}",
        "data.max_prompt_length=64", "data.max_response_length=12", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "rollout.n_gpus_per_node=2", "rollout.total_rollout_steps=8",
        "trainer.test_freq=-1", "trainer.logger=[console]", f"trainer.default_local_dir={tmp_path / 'run'}",
        # no restarts: these check how a broken replica is reported (tests/test_healing_drills.py: how it heals)
        "ray_init.num_cpus=2", f"debug.fail_replicas={fail}", "rollout.max_replica_restarts=0", *extra,
    ]
    t0 = time.monotonic()
    proc = run_main(args)  # the command in this process, on the session's Ray (tests/entry_point.py)
    return proc, time.monotonic() - t0


def test_failed_validation_is_an_error_not_an_accuracy_of_zero(ray_session, tmp_path, tiny_model_dir, data_files):
    """Every replica failing: the validation before training fails (an error, not an accuracy of 0), then the run
    stops with the engine error and exit 1 by itself (one run for both claims)."""
    # val_async=false: the validation before training has the engines alone, so its failure is reported before the
    # engines' failures stop the run (beside training, the run may stop first: tests/test_validation_async.py)
    proc, wall = run_failing(tmp_path, tiny_model_dir, data_files, "all", "trainer.val_before_train=true",
                             "trainer.val_async=false")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    # the validation's error is reported and the run goes on, until the engines' failures stop it
    assert ("warning: the validation before training (version 0) failed, training goes on: ValidationError: "
            "validation at version 0: all 4 generation requests failed (first error: injected failure") in proc.stdout
    assert ("run failed: the rollouter failed: EngineFailure: every engine replica is out of rotation"
            in proc.stderr)
    assert ("run failed: the rollouter failed: EngineFailure: every engine replica is out of rotation "
            "(replica 0: 32 failed requests in a row, last error: injected failure on replica 0") in proc.stderr
    assert "val/mean@1/acc=0.000" not in proc.stdout
    assert wall < STOP_WITHIN_S, wall


def test_one_failing_replica_leaves_the_rotation_and_every_prompt_is_trained(ray_session, tmp_path, tiny_model_dir,
                                                                           data_files):
    # 8 prompts make 16 requests: K=4 so that replica 0 leaves the rotation during the run
    proc, wall = run_failing(tmp_path, tiny_model_dir, data_files, "[0]", "trainer.val_before_train=false",
                          "rollout.max_consecutive_engine_failures=4")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert ("warning: engine replica 0 was taken out of rotation: 4 failed requests in a row, "
            "last error: injected failure on replica 0") in proc.stdout
    with open(tmp_path / "run" / "trained_uids.jsonl") as f:
        uids = [u for line in f if line.strip() for u in json.loads(line)["uids"]]
    assert sorted(collections.Counter(uids).values()) == [1] * 8
    assert wall < STOP_WITHIN_S, wall


def test_validation_with_missing_samples_neither_stops_the_run_nor_loses_its_checkpoint(ray_session, tmp_path,
                                                                                        tiny_model_dir, data_files):
    # the two reproductions in one run: val n=3 over 2 replicas, replica 1 failing, so that prompts lose
    # 1 or 2 of their 3 samples (ragged) before training; save_freq=3 with test_freq=-1 lost the final checkpoint
    # val_async=false: the validation before training alone on the engines (6 of its 12 samples on the failing one)
    proc, wall = run_failing(tmp_path, tiny_model_dir, data_files, "[1]", "trainer.val_before_train=true",
                          "actor_rollout_ref.rollout.val_kwargs.n=3", "trainer.save_freq=3", "trainer.val_async=false")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "validation before training (version 0): val/mean@3/acc=" in proc.stdout
    assert "(6 of 12 validation samples missing: 6 failed requests)" in proc.stdout
    assert "validation after training" not in proc.stdout  # test_freq=-1: no validation at the end either
    # 4 steps, a sync every 2: versions 1 and 2; no save_freq multiple, the end of the run saves version 2
    assert os.path.exists(tmp_path / "run" / "global_step_2" / "actor")
