"""The whole pipeline on real Ray with a tiny model (CPU): invariants that only a real run shows."""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import ray
import torch

from verl_async.config import compose, validate
from verl_async.data import builtin, write_rows
from verl_async.pipeline import PipelineError, run

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rows = builtin.generate_rows("train", 16, seed=3)
    val = builtin.generate_rows("val", 4, seed=4, exclude={r["prompt"][0]["content"] for r in rows})
    write_rows(rows, str(folder / "train.parquet"))
    write_rows(val, str(folder / "val.parquet"))
    return str(folder / "train.parquet"), str(folder / "val.parquet")


def overrides(tmp_path, model_dir, data_files, *extra: str) -> list[str]:
    train, val = data_files
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.max_prompt_length=64",
        "data.max_response_length=12",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.max_num_seqs=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "rollout.total_rollout_steps=8",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.logger=[tensorboard]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "ray_init.num_cpus=4",
        *extra,
    ]


def run_pipeline(tmp_path, model_dir, data_files, *extra: str) -> dict:
    cfg = validate(compose(overrides=overrides(tmp_path, model_dir, data_files, *extra)))
    return run(cfg)


def assert_each_prompt_and_step_once(tmp_path, prompts: int, steps: int) -> None:
    """A run that was stopped and resumed reads as one uninterrupted run: every prompt trained once, and no line of
    the stopped process after its checkpoint left behind (each step logged once, by step: issue 42, item 7)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    counts = collections.Counter(u for entry in trained_log(tmp_path) for u in entry["uids"])
    assert len(counts) == prompts and set(counts.values()) == {1}, counts
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        logged = [json.loads(line)["step"] for line in f if "training/global_step" in line]
    assert logged == list(range(1, steps + 1)), logged
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("critic/score/mean")] == list(range(1, steps + 1))


def trained_log(tmp_path) -> list[dict]:
    with open(tmp_path / "run" / "trained_uids.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def saved_groups(pattern: str, steps: int) -> list[list[dict]]:
    return [torch.load(pattern.format(rollout_id=k), weights_only=False) for k in range(steps)]


@pytest.fixture(scope="module")
def sync_run(ray_session, tmp_path_factory, tiny_model_dir, data_files):
    """One synchronous run (staleness 0, a sync after every step) that also validates every 2 versions and logs 2
    validation generations to tensorboard and the file logger: the on-policy test and the validation-logging test
    assert on it (one run instead of two, issue 39)."""
    root = tmp_path_factory.mktemp("sync")
    pattern = str(root / "dump" / "rollout_{rollout_id}.pt")
    summary = run_pipeline(
        root, tiny_model_dir, data_files,
        "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
        f"debug.save_rollout_data='{pattern}'",
        "trainer.test_freq=2", "trainer.log_val_generations=2", "trainer.logger=[tensorboard,file]",
    )
    return root, summary, pattern


class TestSynchronousRun:
    """One synchronous run (sync_run): strictly on-policy, and its validations logged."""

    def test_synchronous_baseline_is_strictly_on_policy(self, sync_run):
        root, summary, pattern = sync_run
        log = trained_log(root)
        assert summary["trainer/steps"] == 4 and summary["trainer/version"] == 4
        for step, entry in enumerate(log):
            for group in saved_groups(pattern, len(log))[step]:
                versions = {v for r in group["responses"] for v in r["versions"]}
                # every token of every group trained at version v was sampled by version v
                assert versions <= {entry["version"]}, (step, entry["version"], versions)
                assert len(group["responses"]) == 2
        assert os.path.exists(summary["timeline"])

    def test_validation_generations_reach_tensorboard_and_the_file_logger(self, sync_run):
        """trainer.log_val_generations=2 across Ray: the Rollouter picks them, the Trainer's tracker writes them."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        tmp_path = sync_run[0]
        lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        shown = [(x["step"], x["data"]["val/generations"]) for x in lines if "val/generations" in x["data"]]
        assert [step for step, _ in shown] == [2, 4]  # test_freq=2 over 4 versions; the end reuses version 4's
        assert all(len(samples) == 2 and set(samples[0]) == {"input", "output", "score"} for _, samples in shown)
        assert [x["step"] for x in lines if "val/mean@1/acc" in x["data"]] == [2, 4]  # the metrics, logged apart
        events = [f for f in os.listdir(tmp_path / "run" / "tensorboard") if f.startswith("events")]
        acc = EventAccumulator(str(tmp_path / "run" / "tensorboard" / events[0]), size_guidance={"tensors": 0})
        acc.Reload()
        texts = acc.Tensors("val/generations/text_summary")
        assert [t.step for t in texts] == [2, 4] and shown[0][1][0]["input"] in texts[0].tensor_proto.string_val[0].decode()


@pytest.fixture(scope="module")
def async_run(ray_session, tmp_path_factory, tiny_model_dir, data_files):
    """One fully async run (staleness 1, a sync every 2 steps, partial rollout, weights over the gloo collective)
    whose scorer raises on every odd-length response: the exactly-once test, the scorer-exceptions test and the
    collective-transport test assert on it (one run instead of three, issue 39)."""
    root = tmp_path_factory.mktemp("async")
    scorer = root / "flaky_scorer.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    if len(solution_str) % 2:\n"
        "        raise ValueError('pathological response')\n"
        "    return {'score': 1.0, 'acc': 1.0}\n"
    )
    pattern = str(root / "dump" / "rollout_{rollout_id}.pt")
    summary = run_pipeline(
        root, tiny_model_dir, data_files,
        "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=2",
        "async_training.partial_rollout=true", f"debug.save_rollout_data='{pattern}'",
        f"custom_reward_function.path={scorer}", "async_training.sync_transport=gloo",
    )
    return root, summary, pattern


class TestAsyncRun:
    """One fully async run with a flaky scorer (async_run): exactly once, staleness bound, scorer errors counted."""

    def test_async_run_trains_every_prompt_once_in_complete_groups(self, async_run):
        tmp_path, _, pattern = async_run
        log = trained_log(tmp_path)
        uids = [u for entry in log for u in entry["uids"]]
        assert len(uids) == 8 and len(set(uids)) == 8
        for entry, groups in zip(log, saved_groups(pattern, len(log))):
            for g in groups:
                assert len(g["responses"]) == 2
                min_version = min((v for r in g["responses"] for v in r["versions"]), default=g["param_version_start"])
                lived = g["param_version_end"] - g["param_version_start"]
                assert entry["version"] - min_version <= math.ceil(1.0) + lived
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = [f for f in os.listdir(tmp_path / "run" / "tensorboard") if f.startswith("events")]
        acc = EventAccumulator(str(tmp_path / "run" / "tensorboard" / events[0]))
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        for tag in ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "fully_async/staleness/mean",
                    "fully_async/param_version", "fully_async/queue_size", "timing_s/param_sync",
                    "fully_async/trainer_idle_ratio", "rollout/idle_ratio", "perf/trained_tokens_per_s",
                    "response_length/mean"]:
            assert tag in tags, tag
        # bypass mode (the default): the old log-probs are the rollout's, no mismatch is measured or logged
        assert not [t for t in tags if t.startswith("mismatch/")]

    def test_scorer_exceptions_are_counted_and_the_run_continues(self, async_run):
        tmp_path, summary, _ = async_run
        assert summary["trainer/steps"] == 4
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        folder = tmp_path / "run" / "tensorboard"
        acc = EventAccumulator(str(folder / [f for f in os.listdir(folder) if f.startswith("events")][0]))
        acc.Reload()
        assert acc.Scalars("reward/scorer_errors")[-1].value > 0

    def test_every_sync_is_a_gloo_collective(self, async_run):
        """The real pipeline (Rollouter, queue, Trainer) with sync_transport=gloo: every sync is a collective."""
        from verl_async.utils.timeline import read_spans

        tmp_path, summary, _ = async_run
        assert summary["trainer/steps"] == 4 and summary["trainer/version"] == 2
        syncs = [s for s in read_spans(str(tmp_path / "run" / "timeline.jsonl")) if s["kind"] == "sync"]
        assert len(syncs) >= 3  # the initial push + one per version
        from verl_async.utils.tb_read import read_scalars

        ranks = read_scalars(str(tmp_path / "run"))["sync/engine_ranks"]  # the collective's own metric
        assert [p.value for p in ranks] == [1.0, 1.0]  # versions 1 and 2 broadcast to the one engine rank


@pytest.fixture(scope="module")
def saved_rollouts(ray_session, tmp_path_factory, tiny_model_dir, data_files) -> str:
    """The groups of a rollout-only run, saved per step (debug.save_rollout_data): the train-only tests' input."""
    root = tmp_path_factory.mktemp("rollout_only")
    pattern = str(root / "dump" / "rollout_{rollout_id}.pt")
    run_pipeline(root, tiny_model_dir, data_files, "debug.rollout_only=true", f"debug.save_rollout_data='{pattern}'")
    assert len(trained_log(root)) == 4  # rollout-only still records what it produced
    return pattern


def train_only_command(folder, saved_rollouts: str, *steps: int) -> tuple[str, ...]:
    """debug.load_rollout_data over the saved groups of `steps` (copied into `folder`), a checkpoint at every sync,
    resume on, recomputed old log-probs, each step's training outputs saved (debug.save_train_output)."""
    (folder / "rollouts").mkdir(parents=True, exist_ok=True)
    pattern = str(folder / "rollouts" / "rollout_{rollout_id}.pt")
    for k in steps:
        shutil.copy(saved_rollouts.format(rollout_id=k), pattern.format(rollout_id=k))
    out = str(folder / "train" / "step{rollout_id}_rank{rank}.pt")
    return (f"debug.load_rollout_data='{pattern}'", "trainer.save_freq=1", "trainer.resume_mode=auto",
            f"debug.save_train_output='{out}'", "async_training.use_rollout_log_probs=false")


@pytest.fixture(scope="module")
def train_only_runs(ray_session, tmp_path_factory, tiny_model_dir, data_files, saved_rollouts):
    """Two train-only runs in one folder: steps 0-1, then (steps 2-3 added) the resume. The checkpoint test asserts
    on both; the replay test reruns the first elsewhere and compares (three runs for two tests, issue 39)."""
    root = tmp_path_factory.mktemp("train_only")
    first = run_pipeline(root, tiny_model_dir, data_files, *train_only_command(root, saved_rollouts, 0, 1))
    checkpoint_1 = os.path.exists(root / "run" / "global_step_1" / "actor")
    second = run_pipeline(root, tiny_model_dir, data_files, *train_only_command(root, saved_rollouts, 2, 3))
    return root, first, checkpoint_1, second


class TestTrainOnly:
    """Train-only runs over a rollout-only run's saved groups (saved_rollouts, train_only_runs)."""

    def test_train_only_replays_saved_rollouts(self, ray_session, tmp_path, tiny_model_dir, data_files, saved_rollouts,
                                               train_only_runs):
        run_pipeline(tmp_path, tiny_model_dir, data_files, *train_only_command(tmp_path, saved_rollouts, 0, 1))
        outputs = [str(folder / "train" / "step0_rank0.pt") for folder in (train_only_runs[0], tmp_path)]
        # Same inputs, same seed: the two train-only runs agree to the bit.
        result = subprocess.run(
            [sys.executable, os.path.join(REPO, "scripts", "compare_train_output.py"), *outputs],
            capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "identical" in result.stdout

    def test_train_only_checkpoints_and_resumes_like_a_normal_run(self, train_only_runs, saved_rollouts):
        """debug.load_rollout_data: the checkpoints of save_freq are written, and a second run resumes from them."""
        root, first, checkpoint_1, second = train_only_runs
        assert first["trainer/steps"] == 2 and first["trainer/version"] == 1  # a sync every 2 steps
        assert checkpoint_1
        # the same run directory, more data: the run resumes at step 2, version 1
        assert second["trainer/steps"] == 4 and second["trainer/version"] == 2
        assert os.path.exists(root / "run" / "global_step_2" / "actor")
        saved = [[g["uid"] for g in groups] for groups in saved_groups(saved_rollouts, 4)]
        assert [(e["step"], e["uids"]) for e in trained_log(root)] == list(enumerate(saved))


class TestReplicaKilledForGood:
    def test_a_replica_killed_for_good_with_no_other_stops_the_run_with_the_cause(self, ray_session, tmp_path,
                                                                                  tiny_model_dir, data_files):
        """`ray.kill` ends a replica for good (Ray does not restart it): its healing fails, it is retired, and with no
        other replica the run stops naming it (a replica that Ray restarts heals: tests/test_healing_drills.py)."""
        def replica_names() -> set[tuple[str, str]]:
            return {(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith("verl_async_replica")}

        # A replica of an earlier run on the session's Ray may still be listed while it winds down: kill only this run's.
        earlier = replica_names()

        def kill_a_replica():
            deadline = time.time() + 120
            while time.time() < deadline:
                names = sorted(replica_names() - earlier)
                log = tmp_path / "run" / "trained_uids.jsonl"
                if names and log.exists() and log.read_text().strip():  # training is under way
                    time.sleep(0.5)
                    name, namespace = names[0]
                    ray.kill(ray.get_actor(name, namespace=namespace))
                    return
                time.sleep(0.2)

        killer = threading.Thread(target=kill_a_replica, daemon=True)
        killer.start()
        with pytest.raises(PipelineError, match=r"(?s)rollouter failed: EngineFailure: every engine replica is out of "
                                                r"rotation \(replica 0: its restart failed: ActorDiedError.*EngineReplica"):
            # Enough epochs that the run is still generating when the replica dies, however fast the machine.
            run_pipeline(tmp_path, tiny_model_dir, data_files, "rollout.total_epochs=100", "rollout.total_rollout_steps=800",
                         "data.max_response_length=48")
        killer.join(timeout=10)


class TestFilterGroups:
    def test_filter_groups_keeps_flat_groups_out_of_training(self, ray_session, tmp_path, tiny_model_dir, data_files):
        """DAPO dynamic sampling on the real pipeline: even rows score 0 for every response (dropped at the
        Rollouter), odd rows a per-response hash (kept); every trained response carries an advantage."""
        scorer = tmp_path / "half_flat.py"
        scorer.write_text(
            "import zlib\n"
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
            "    if extra_info['index'] % 2 == 0:\n"
            "        return {'score': 0.0, 'acc': 0.0}\n"
            "    return {'score': (zlib.crc32(solution_str.encode()) % 997 + 1) / 997, 'acc': 0.0}\n"
        )
        summary = run_pipeline(
            tmp_path, tiny_model_dir, data_files, f"custom_reward_function.path={scorer}",
            "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
            "algorithm.filter_groups.max_num_gen_batches=4",
            "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
        )
        steps = trained_log(tmp_path)
        trained = [u for entry in steps for u in entry["uids"]]
        with open(tmp_path / "run" / "rollout" / "filtered_groups.jsonl") as f:
            filtered = [json.loads(line) for line in f]
        assert filtered and all(r["index"] % 2 == 0 for r in filtered)
        assert trained and all(int(u.split(":")[1]) % 2 == 1 for u in trained)
        assert len(trained) + len(filtered) == 8 and len(set(trained) | {r["uid"] for r in filtered}) == 8
        assert all(len(entry["uids"]) == 2 for entry in steps[:-1])  # full batches (the last one may be the tail)
        assert summary["rollout/filtered_groups"] == len(filtered)
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        folder = tmp_path / "run" / "tensorboard"
        acc = EventAccumulator(str(folder / [f for f in os.listdir(folder) if f.startswith("events")][0]))
        acc.Reload()
        assert {e.value for e in acc.Scalars("critic/nonzero_adv_frac")} == {1.0}
        logged = acc.Scalars("fully_async/filtered_groups")[-1].value  # at the last step: the tail may come after
        assert 0 < logged <= len(filtered)
        assert acc.Scalars("fully_async/filtered_groups/verl_async/builtin_repeat")[-1].value == logged


class TestTotalTrainingSteps:
    def test_total_training_steps_ends_the_run_and_a_larger_cap_resumes_exactly_once(self, ray_session, tmp_path,
                                                                                      tiny_model_dir, data_files):
        """trainer.total_training_steps stops the trainer (and the Rollouter) there with a checkpoint; a second
        run with a larger cap resumes from it and every prompt is trained once over both runs."""
        capped = ("rollout.total_rollout_steps=16", "trainer.save_freq=4", "trainer.resume_mode=auto",
                  "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1",
                  "trainer.logger=[tensorboard,file]")
        first = run_pipeline(tmp_path, tiny_model_dir, data_files, *capped, "trainer.total_training_steps=3")
        assert first["trainer/steps"] == 3 and first["trainer/version"] == 3
        assert os.path.exists(tmp_path / "run" / "global_step_3" / "actor")  # at the cap, although save_freq=4
        assert [e["step"] for e in trained_log(tmp_path)] == [0, 1, 2]
        second = run_pipeline(tmp_path, tiny_model_dir, data_files, *capped, "trainer.total_training_steps=8")
        assert second["trainer/steps"] == 8
        assert_each_prompt_and_step_once(tmp_path, prompts=16, steps=8)

