"""Start-up and resume as a user sees them (issue 28, item 11): what a run resumes, and that it says so;
a checkpoint of another run stops it before anything is written; the last line counts this process's
steps; Ctrl-C ends with one line and the command that resumes; --help shows what a user needs first."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys

import pytest

from tests.test_entry import _env, run_entry, write_parquet
from verl_async.config import ConfigError, compose, validate
from verl_async.config.cli import REPO_ROOT
from verl_async.config.resume import plan_resume
from verl_async import checkpoint as ckpt

A = "actor_rollout_ref"


def make_checkpoint(root, step: int, model_path: str, **run_info) -> str:
    """A checkpoint folder as the worker group publishes it: the ranks' meta.json, the driver's run_info.json."""
    path = ckpt.checkpoint_dir(str(root), step)
    os.makedirs(path)
    meta = {"global_step": step, "world_size": 1, "model_path": model_path}
    meta.update(run_info.pop("meta", {}))
    with open(os.path.join(path, ckpt.COMPLETE_MARKER), "w") as f:
        json.dump(meta, f)
    ckpt.write_run_info(path, {"step": step, "version": step, "rollout_n": 8, "train_prompts": 64, **run_info})
    ckpt.mark_latest(str(root), step)
    return path


@pytest.fixture
def train_file(tmp_path):
    return write_parquet(tmp_path / "train.parquet", 64)  # 64 prompts, 8 per step: 8 steps


def args(tmp_path, model, train, *extra: str) -> list[str]:
    return [f"{A}.model.path={model}", f"data.train_files={train}", "data.val_files=null",
            f"trainer.default_local_dir={tmp_path / 'run'}", *extra]


def config(tmp_path, model, train, *extra: str):
    return validate(compose("fully_async_ppo_trainer", args(tmp_path, model, train, *extra)))


# --------------------------------------------------------------------------- what a run resumes
def test_plan_says_fresh_or_resuming_with_the_step(tmp_path, tiny_model_dir, train_file):
    cfg = config(tmp_path, tiny_model_dir, train_file)
    assert plan_resume(cfg, 64).describe() == f"starting fresh (no checkpoint in {tmp_path / 'run'})"
    path = make_checkpoint(tmp_path / "run", 4, tiny_model_dir)
    assert plan_resume(cfg, 64).describe() == f"resuming from {path} (step 4 of 8)"
    capped = config(tmp_path, tiny_model_dir, train_file, "rollout.total_rollout_steps=36")
    assert plan_resume(capped, 64).describe() == f"resuming from {path} (step 4 of 5)"  # ceil(36 / 8)
    off = config(tmp_path, tiny_model_dir, train_file, "trainer.resume_mode=disable")
    assert plan_resume(off, 64).describe() == "starting fresh (trainer.resume_mode=disable)"
    rollout_only = config(tmp_path, tiny_model_dir, train_file, "debug.rollout_only=true")
    assert plan_resume(rollout_only, 64).describe() == "starting fresh (debug.rollout_only=true loads no checkpoint)"


@pytest.mark.parametrize(
    "run_info,overrides,key,words",
    [
        ({"rollout_n": 4}, [], f"{A}.rollout.n", "holds groups of 4 responses (queued and in flight); this run samples 8"),
        ({"train_prompts": 60}, [], "data.train_files", "kept its data cursor over 60 training prompts; this run has 64"),
        ({"meta": {"backend": "megatron", "layout": {}}}, [], f"{A}.actor.strategy",
         "was written by megatron; this run uses fsdp2"),
    ],
)
def test_a_checkpoint_this_run_cannot_continue_is_named(tmp_path, tiny_model_dir, train_file, run_info, overrides,
                                                        key, words):
    path = make_checkpoint(tmp_path / "run", 4, tiny_model_dir, **run_info)
    with pytest.raises(ConfigError) as info:
        plan_resume(config(tmp_path, tiny_model_dir, train_file, *overrides), 64)
    assert info.value.key == key and f"would resume, {path}, {words}" in info.value.reason, info.value


def test_megatron_layout_change_names_the_parallel_size(tmp_path, tiny_model_dir, train_file):
    layout = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
              "use_distributed_optimizer": True}
    make_checkpoint(tmp_path / "run", 4, tiny_model_dir, meta={"backend": "megatron", "layout": layout})
    cfg = validate(compose("fully_async_ppo_megatron_trainer", args(tmp_path, tiny_model_dir, train_file)))
    with pytest.raises(ConfigError) as info:
        plan_resume(cfg, 64)
    assert info.value.key == f"{A}.actor.megatron.tensor_model_parallel_size", info.value


def test_a_checkpoint_named_explicitly_may_continue_under_another_model_folder(tmp_path, tiny_model_dir, train_file,
                                                                              capsys):
    path = make_checkpoint(tmp_path / "old_run", 4, "/models/moved")
    cfg = config(tmp_path, tiny_model_dir, train_file, "trainer.resume_mode=resume_path",
                 f"trainer.resume_from_path={path}")
    assert plan_resume(cfg, 64).describe() == f"resuming from {path} (step 4 of 8)"
    assert f"warning: {path} was trained from /models/moved" in capsys.readouterr().out


def test_checkpoint_of_another_model_stops_before_anything_is_written(tmp_path, tiny_model_dir, train_file):
    """Every config defaults to experiment_name=demo and resume_mode=auto: a new job (another model) in an old
    run's folder overwrote its config.yaml, then failed with `CheckpointException ... Size mismatch`."""
    run = tmp_path / "run"
    path = make_checkpoint(run, 4, "/models/Qwen2.5-0.5B")
    (run / "config.yaml").write_text("the old run's config\n")
    before = sorted(str(p) for p in run.rglob("*"))
    proc = run_entry(*args(tmp_path, tiny_model_dir, train_file), f"hydra.run.dir={tmp_path / 'hydra'}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"config error: {A}.model.path: the checkpoint trainer.resume_mode=auto would resume, "
                           f"{path}, was trained from /models/Qwen2.5-0.5B; this run trains {tiny_model_dir}."), line
    assert "trainer.experiment_name" in line and "trainer.resume_mode=disable" in line
    assert sorted(str(p) for p in run.rglob("*")) == before
    assert (run / "config.yaml").read_text() == "the old run's config\n"


def test_a_torn_publish_is_what_the_preflight_resumes(tmp_path, tiny_model_dir, train_file):
    """The checkpoint a kill between publish()'s renames left is found, and named, before Ray starts."""
    path = make_checkpoint(tmp_path / "run", 4, tiny_model_dir)
    torn = ckpt.step_folder(str(tmp_path / "run"), 4) + ckpt.REPLACED_SUFFIX
    os.replace(os.path.dirname(path), torn)
    assert plan_resume(config(tmp_path, tiny_model_dir, train_file), 64).describe() == \
        f"resuming from {torn}/actor (step 4 of 8)"


# --------------------------------------------------------------------------- the last line
def test_last_line_counts_the_steps_this_process_trained(tmp_path, capsys):
    """A run resumed at step 8 that trains to step 20 said "20 steps" when 12 ran."""
    from verl_async.pipeline import _summarise

    results = {"trainer": {"steps": 20, "start_step": 8, "version": 10}}
    summary = _summarise(str(tmp_path), results, {}, {}, 12.0)
    assert summary["trainer/steps"] == 20 and summary["trainer/start_step"] == 8
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("done in 12.0s: 12 steps trained (resumed at step 8, now at step 20), version 10"), line
    _summarise(str(tmp_path), {"trainer": {"steps": 5, "start_step": 0, "version": 5}}, {}, {}, 3.0)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("done in 3.0s: 5 steps trained, version 5")


# --------------------------------------------------------------------------- Ctrl-C
SLOW_PIPELINE = """
import runpy, signal, sys, time
import verl_async.pipeline as pipeline

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job inherits SIG_IGN)

def run(cfg, **_):  # the start-up phases before it come as a keyword
    print("training", flush=True)
    time.sleep(600)

pipeline.run = run
sys.argv = ["fully_async_main", *sys.argv[1:]]
runpy.run_module("recipe.fully_async_main", run_name="__main__")
"""


def interrupt(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PIPELINE, *argv], cwd=REPO_ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the config summary, then the pipeline's first line
        if line.strip() == "training":
            break
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_ends_with_one_line_and_the_command_that_resumes(tmp_path, tiny_model_dir, train_file):
    """Ctrl-C printed a 50-line KeyboardInterrupt traceback and no hint that the same command resumes."""
    path = make_checkpoint(tmp_path / "run", 4, tiny_model_dir)
    argv = [*args(tmp_path, tiny_model_dir, train_file), "trainer.save_freq=2", "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={path}", f"hydra.run.dir={tmp_path / 'hydra'}"]
    done = interrupt(argv)
    assert done.returncode == 130, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    head, _, command = lines[0].partition(" Resume with: ")
    assert head == f"interrupted; the newest checkpoint is {path} (step 4)."
    words = shlex.split(command)
    assert words[1:3] == ["-m", "recipe.fully_async_main"]
    assert words[3:] == [a for a in argv if not a.startswith("trainer.resume_mode=")] + ["trainer.resume_mode=auto"]
    resumed = subprocess.run([sys.executable, *words[1:]], cwd=REPO_ROOT, env=_env(VERL_ASYNC_DRY_RUN="1"),
                             capture_output=True, text=True, timeout=120)
    assert f"checkpoint   resuming from {path} (step 4 of 8)" in resumed.stdout, resumed.stdout + resumed.stderr


def test_ctrl_c_without_checkpoints_says_nothing_can_be_resumed(tmp_path, tiny_model_dir, train_file):
    done = interrupt([*args(tmp_path, tiny_model_dir, train_file), f"hydra.run.dir={tmp_path / 'hydra'}"])
    assert done.returncode == 130 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-3000:]
    assert done.stderr.startswith("interrupted; nothing to resume: trainer.save_freq=-1 writes no checkpoint")


# --------------------------------------------------------------------------- --help
def test_help_shows_what_a_user_needs_before_the_full_config():
    proc = run_entry("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, _, rest = proc.stdout.partition("== Config ==")
    assert rest, "Hydra's full config dump follows"
    for needed in ("usage: python -m recipe.fully_async_main", f"{A}.model.path", "data.train_files",
                   "builtin://tiny", "builtin://smollm2-135m-instruct", "builtin://train", "VERL_ASYNC_DRY_RUN=1",
                   "python -m recipe.fully_async_main \\", "trainer.resume_mode", "trainer.save_freq"):
        assert needed in first, needed
    assert first.index("usage:") < first.index("powered by Hydra")


# --------------------------------------------------------------------------- a folder holds one run (issue 42, item 7)
def test_a_folder_holding_another_runs_records_gives_the_run_a_new_folder(tmp_path, tiny_model_dir, train_file):
    """The README's demo and then its multi-turn command both wrote outputs/verl_async/demo: the second overwrote
    config.yaml and trained_uids.jsonl and appended to the first's logs."""
    from verl_async.config.run_folder import claim

    cfg = config(tmp_path, tiny_model_dir, train_file)
    plan, moved = claim(cfg, plan_resume(cfg, 64), 64)
    assert moved is None and plan.root == str(tmp_path / "run")  # nothing there yet: its own
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("the first run\n")
    (tmp_path / "run" / "tensorboard").mkdir()
    plan, moved = claim(cfg, plan_resume(cfg, 64), 64)
    assert plan.root == str(tmp_path / "run-2") and plan.path is None
    assert moved == (f"{tmp_path / 'run'} holds another run's records (config.yaml, tensorboard/) and no checkpoint "
                     f"this run continues: this run writes to {tmp_path / 'run-2'} (set trainer.experiment_name or "
                     "trainer.default_local_dir to choose)")
    (tmp_path / "run-2").mkdir()
    (tmp_path / "run-2" / "metrics.jsonl").write_text("")
    assert claim(cfg, plan_resume(cfg, 64), 64)[0].root == str(tmp_path / "run-3")
    # the same command, moved before and checkpointed there, continues its own run (not run-4)
    (tmp_path / "run-3").mkdir()
    (tmp_path / "run-3" / "config.yaml").write_text("")
    path = make_checkpoint(tmp_path / "run-3", 2, tiny_model_dir)
    plan, moved = claim(cfg, plan_resume(cfg, 64), 64)
    assert plan.root == str(tmp_path / "run-3") and plan.path == path and moved.endswith(
        f"this run continues {path} (set trainer.experiment_name or trainer.default_local_dir to choose)")
    other = config(tmp_path, tiny_model_dir, train_file, f"trainer.default_local_dir={tmp_path / 'other'}")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.yaml").write_text("")
    make_checkpoint(tmp_path / "other-2", 2, "/models/another")  # another run's checkpoint is not continued
    assert claim(other, plan_resume(other, 64), 64)[0].root == str(tmp_path / "other-3")


def test_a_run_that_continues_its_folders_checkpoint_stays_and_one_that_does_not_moves(tmp_path, tiny_model_dir,
                                                                                        train_file):
    from verl_async.config.run_folder import claim

    path = make_checkpoint(tmp_path / "run", 4, tiny_model_dir)
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    cfg = config(tmp_path, tiny_model_dir, train_file)
    plan, moved = claim(cfg, plan_resume(cfg, 64), 64)
    assert moved is None and plan.path == path and not plan.finished
    off = config(tmp_path, tiny_model_dir, train_file, "trainer.resume_mode=disable")
    plan, moved = claim(off, plan_resume(off, 64), 64)
    assert plan.root == str(tmp_path / "run-2") and plan.path is None
    assert "(metrics.jsonl, global_step_*/)" in moved
    assert plan.describe() == "starting fresh (trainer.resume_mode=disable)"


def test_a_finished_run_rerun_has_nothing_to_train(tmp_path, tiny_model_dir, train_file):
    from verl_async.config.resume import ends_at

    cfg = config(tmp_path, tiny_model_dir, train_file, "trainer.total_training_steps=5")
    make_checkpoint(tmp_path / "run", 5, tiny_model_dir, finished=True, ends_at=ends_at(cfg))
    plan = plan_resume(cfg, 64)
    assert plan.finished and plan.total_steps == 5
    assert plan.nothing_to_do().startswith(f"nothing to train: {plan.path} is the end of this run (step 5 of 5). ")
    more = config(tmp_path, tiny_model_dir, train_file, "trainer.total_training_steps=7")  # asks for more: continues
    assert not plan_resume(more, 64).finished
    # ended with its data (a filtered run ends before its planned step): finished while the end keys are the same
    make_checkpoint(tmp_path / "run", 6, tiny_model_dir, finished=True, ends_at=ends_at(config(tmp_path, tiny_model_dir,
                                                                                              train_file)))
    assert plan_resume(config(tmp_path, tiny_model_dir, train_file), 64).finished
    assert not plan_resume(config(tmp_path, tiny_model_dir, train_file, "rollout.total_epochs=2"), 64).finished
    make_checkpoint(tmp_path / "run", 8, tiny_model_dir)  # an older checkpoint's last step: 64 prompts / 8 = 8 steps
    assert plan_resume(config(tmp_path, tiny_model_dir, train_file), 64).finished


def test_rerunning_a_finished_run_exits_at_once_without_ray(tmp_path, tiny_model_dir, train_file):
    """It trained 0 steps but started Ray and validated twice (50 s)."""
    from verl_async.config.resume import ends_at

    make_checkpoint(tmp_path / "run", 8, tiny_model_dir, finished=True,
                    ends_at=ends_at(config(tmp_path, tiny_model_dir, train_file)))
    proc = run_entry(*args(tmp_path, tiny_model_dir, train_file), f"hydra.run.dir={tmp_path / 'hydra'}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"nothing to train: {tmp_path / 'run'}/global_step_8/actor is the end of this run (step 8 "
                           "of 8)"), last
    assert "Ray" not in proc.stdout + proc.stderr and not (tmp_path / "run" / "config.yaml").exists()
