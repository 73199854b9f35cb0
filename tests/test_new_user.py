"""What a new user meets, run as a user runs it (issue 42): `python -m recipe.fully_async_main` three times in one
folder. A run whose every group is filtered fails in one line instead of "done: 0 steps trained"; the next run,
pointed at the same folder, gets a folder of its own and says so; its metrics go by trainer step (console,
metrics.jsonl, TensorBoard) with verl's names beside ours; the same command again has nothing to train and ends
at once, before Ray starts. The second run is a process of its own (its actors' console lines reach its stdout);
the first and third call the same command in the test process (tests/entry_point.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.entry_point import run_main
from tests.test_entry import _env
from verl_async.config.cli import REPO_ROOT
from verl_async.data import builtin, write_rows
from verl_async.utils.timeline import read_spans

pytestmark = pytest.mark.slow


def in_this_process(*args: str) -> subprocess.CompletedProcess:
    """The same command in the test process, on the session's Ray (tests/entry_point.py): for a run whose every
    line to check is the driver's (the actors' console lines reach a command's own stdout only)."""
    return run_main(list(args), env=_env(RAY_DEDUP_LOGS="0"), cwd=str(REPO_ROOT))


def entry(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipe.fully_async_main", *args], cwd=REPO_ROOT,
                          env=_env(RAY_DEDUP_LOGS="0"), capture_output=True, text=True, timeout=timeout)


def test_a_new_users_three_runs_in_one_folder(ray_session, tmp_path, tiny_model_dir):
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    rows = builtin.generate_rows("train", 8, seed=3)
    write_rows(rows, str(train))
    write_rows(builtin.generate_rows("val", 4, seed=4, exclude={r["prompt"][0]["content"] for r in rows}), str(val))
    common = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={train}", f"data.val_files={val}",
              "data.max_prompt_length=64", "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
              "actor_rollout_ref.actor.ppo_mini_batch_size=2", "ray_init.num_cpus=2",
              f"trainer.default_local_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'hydra'}"]

    # 1. a random model never answers right: DAPO's filter drops every group; it "succeeded" with 0 steps
    filtered = in_this_process(*common, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                               "trainer.val_before_train=false", "trainer.test_freq=-1")
    assert filtered.returncode == 1, filtered.stdout[-3000:] + filtered.stderr[-3000:]
    last = filtered.stderr.strip().splitlines()[-1]
    assert last.startswith("run failed: trained 0 steps: algorithm.filter_groups dropped every group generated (8): "
                           "each group's responses all scored the same, so no batch of 2 groups formed; set "
                           "algorithm.filter_groups.enable=false"), last
    assert (tmp_path / "run" / "config.yaml").exists()

    # 2. the next command into the same folder gets its own, said on the summary; metrics by step, verl's names too
    args = [*common, "async_training.trigger_parameter_sync_step=2", "trainer.save_freq=1", "trainer.test_freq=1",
            "trainer.logger=[console,file,tensorboard]"]
    trained = entry(*args)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    own = tmp_path / "run-2"
    assert (f"             {tmp_path / 'run'} holds another run's records (config.yaml, ") in trained.stdout
    assert f"no checkpoint this run continues: this run writes to {own} (set trainer.experiment_name" in trained.stdout
    assert f"outputs      {own}  (loggers: console, file, tensorboard)" in trained.stdout
    assert trained.stdout.strip().splitlines()[-1].startswith("done in ") and "4 steps trained, version 2" in trained.stdout
    # where its start-up went (utils/startup.py): above the last line, one line per process; the same in the timeline
    lines = trained.stdout.strip().splitlines()
    assert lines[-7].startswith("start-up: first generated token at ") and " s after the command), " in lines[-7]
    assert [line.split()[0] for line in lines[-6:-1]] == ["driver", "rollouter", "replica0", "trainer", "rank0"]
    startup = [s for s in read_spans(str(own / "timeline.jsonl")) if s["kind"] == "startup"]
    phases = {(s["lane"], s["info"]["phase"]) for s in startup}
    for lane, phase in [("driver", "entry"), ("driver", "checks"), ("driver", "ray_init"), ("driver", "actors"),
                        ("driver", "first_sync"), ("rollouter", "worker"),
                        ("rollouter", "data"), ("rollouter", "wait_engines"), ("replica0", "imports"),
                        ("replica0", "model_imports"), ("replica0", "model_load"), ("trainer", "ranks_init"),
                        ("rank0", "dist_init"), ("rank0", "model_imports"), ("rank0", "model_load"),
                        ("rank0", "fsdp_wrap"), ("rank0", "optimizer"), ("driver", "tokenizer")]:
        assert (f"startup/{lane}", phase) in phases, (lane, phase, sorted(phases))
    first_token = min(s["start"] for s in read_spans(str(own / "timeline.jsonl")) if s["kind"] == "generate")
    assert min(s["start"] for s in startup) < 0 < first_token  # the entry point's checks come before the run
    assert all(s["start"] <= s["end"] <= first_token + 1e-3 for s in startup), startup
    # the validation before training ran beside the first training rollouts (val_async): its line came when it ended
    assert ("driver", "val_before_train") not in {(s["lane"][len("startup/"):], s["info"]["phase"]) for s in startup}
    assert "validation before training (version 0): val/mean@1/acc=" in trained.stdout
    # console lines come one to a line (the driver prints them above its bar: no bar text glued before them)
    step_lines = [line for line in trained.stdout.splitlines() if " critic/score/mean=" in line]
    assert [line[:7] for line in step_lines] == ["[    1]", "[    2]", "[    3]", "[    4]"], trained.stdout[-3000:]
    records = [json.loads(line) for line in (own / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if "training/global_step" in r["data"]]
    assert train_steps == [1, 2, 3, 4] and all(r["data"]["training/global_step"] == r["step"] for r in records
                                               if "training/global_step" in r["data"])
    by_step = {r["step"]: r["data"] for r in records if "training/global_step" in r["data"]}
    for key in ("critic/rewards/mean", "critic/advantages/min", "timing_s/gen", "timing_s/adv",
                "perf/throughput", "perf/total_num_tokens", "perf/time_per_step", "fully_async/param_version"):
        assert key in by_step[4], key
    assert by_step[2]["fully_async/param_version"] == 1.0 and by_step[4]["fully_async/param_version"] == 2.0
    # validations: version 0 at step 0, version 1 (made at step 2) at step 2, version 2 at step 4
    val_steps = sorted(r["step"] for r in records if any(k.startswith("val-core/") for k in r["data"]))
    assert val_steps == [0, 2, 4], records
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(own / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("critic/score/mean")] == [1, 2, 3, 4]

    # 3. the same command again: its run is finished; it says so at once, Ray never starts
    t0 = time.monotonic()
    again = in_this_process(*args)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1].startswith(f"nothing to train: {own}/global_step_2/actor is the end "
                                                          "of this run (step 4 of 4)"), again.stdout[-2000:]
    assert "placement:" not in again.stdout and "Ray" not in again.stdout + again.stderr
    assert time.monotonic() - t0 < 60
    assert sorted(os.listdir(tmp_path)).count("run-3") == 0
