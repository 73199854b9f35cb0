"""Fault drills on CPU (docs/healing.md): real processes killed with SIGKILL under `python -m recipe.fully_async_main`.

One run is killed (`kill -9` of its process group, as by hand) after its second checkpoint and started
again with the same command (in the test process, on the session's Ray: tests/entry_point.py), which
continues the responses that checkpoint held in flight; that run then takes every process fault: an
engine replica dies in the middle of a request (`debug.fail_replicas=['0:die@N']`), a trainer rank
dies in the middle of an update and the Trainer actor during a sync (`debug.fail_trainer`). It heals
from each. Across both, every prompt is trained exactly once and the steps are those of an
uninterrupted run, in the trained log, metrics.jsonl and TensorBoard (nothing the killed process
logged after its checkpoint left behind). This drill is also the killed driver's test (the run killed
as a whole and resumed by the same command). A second drill kills a whole Ray node
(ray.cluster_utils) that holds the engine replicas: they restart on the spare node and rejoin.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.entry_point import ran_in_a_fresh_process, run_main
from tests.test_pipeline_integration import assert_each_prompt_and_step_once
from verl_async.data import builtin, write_rows

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = 32  # 16 steps of 2 groups, a sync every 2 steps: versions 1..8


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    write_rows(builtin.generate_rows("train", PROMPTS, seed=3), str(path))
    return str(path)


def in_flight_tokens(checkpoint) -> int:
    """The model tokens of the responses a checkpoint holds in flight (the Rollouter's pending prompts' `resume`)."""
    import torch

    from verl_async.rollout.partials import model_tokens

    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)["extra"]["rollouter"]
    return sum(model_tokens(saved) for item in state["pending"] for saved in (item.get("resume") or {}).values())


def trained(run_dir) -> tuple[collections.Counter, list[int]]:
    uids, steps = collections.Counter(), []
    with open(os.path.join(run_dir, "trained_uids.jsonl")) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                steps.append(record["step"])
                uids.update(record["uids"])
    return uids, steps


def test_a_killed_run_resumes_its_partial_responses_and_heals_from_a_dead_replica_rank_and_trainer(
        ray_session, tmp_path, tiny_model_dir, train_file):
    run = tmp_path / "run"
    args = [
        sys.executable, "-m", "recipe.fully_async_main", f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={train_file}", "data.val_files=null", "data.max_prompt_length=64",
        "data.max_response_length=48", "actor_rollout_ref.rollout.ignore_eos=true",
        # one sequence per replica: a sync often finds requests in flight (not always: see in_flight_tokens below)
        "actor_rollout_ref.rollout.max_num_seqs=1", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "rollout.n_gpus_per_node=2", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.logger=[console,file,tensorboard]", "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=3", f"trainer.default_local_dir={run}", "ray_init.num_cpus=2",
        "debug.fail_replicas=['0:die@5']", "debug.fail_trainer=[rank0:die@update6,actor:die@sync5]",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    env = dict(os.environ, PYTHONPATH=REPO)
    # 1. the whole run killed (kill -9 of its process group, as by hand) once the checkpoint of version 2 is out
    marker = run / "global_step_2" / "actor" / "meta.json"
    with open(tmp_path / "first.log", "w") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not marker.exists() and proc.poll() is None:
        time.sleep(0.05)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)
    assert marker.exists(), (tmp_path / "first.log").read_text()[-4000:]
    held = in_flight_tokens(run / "global_step_2" / "actor")  # read now: the resumed run keeps the 3 newest only

    # 2. the same command (in this process: tests/entry_point.py): it continues the responses that checkpoint held in
    # flight, and heals from the rest
    resumed = run_main(args[3:], env=env)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-4000:]
    assert f"resuming from {run}/global_step_2/actor (step 4 of 16)" in out, out[-3000:]
    said = re.search(r"^resume: (\d+) response\(s\) in flight at the checkpoint continued \((\d+) of its (\d+) tokens\), "
                     r"(\d+) token\(s\) regenerated$", out, re.M)
    assert said, out[-3000:]
    responses, continued, saved, regenerated = map(int, said.groups())
    # What the checkpoint held in flight is a race of the two sides (generation ahead by its staleness budget holds at
    # the sync with nothing in flight; behind, it is aborted mid-response): read it from the checkpoint itself.
    assert continued == saved == held and regenerated == 0 and (responses >= 1) == (held > 0)
    # the replica: lost in its 5th request (a SIGKILL mid-generation), restarted in its bundle, back with the weights
    assert re.search(r"^healed: engine replica 0 was lost \(.*\); restarted in [\d.]+ s, rejoined [\d.]+ s after the loss "
                     r"with the weights of version \d+$", out, re.M), out[-4000:]
    # the trainer: rank 0 died in the update of step 6 (newest checkpoint: version 2 = step 4, the first run's), the
    # actor in the sync to version 5 (its weights on the engines, not yet its checkpoint: version 4 = step 8)
    healed = re.findall(r"^healed: the trainer restarted from (\S+) at step (\d+) in ([\d.]+) s; (\d+) group\(s\)",
                        out, re.M)
    assert [(os.path.basename(os.path.dirname(p)), int(s), int(g)) for p, s, _, g in healed] == \
        [("global_step_2", 4, 4), ("global_step_4", 8, 4)], out[-4000:]  # steps 5-6's groups; steps 9-10's
    assert "12 steps trained (resumed at step 4, now at step 16), version 8" in out
    metrics = [json.loads(line)["data"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert max(m.get("fault/trainer_restarts", 0) for m in metrics) == 2
    assert all(m["fault/trainer_recovery_s"] > 0 for m in metrics if "fault/trainer_recovery_s" in m)
    assert max(m.get("fault/replica_restarts", 0) for m in metrics) >= 1
    assert max(m.get("resume/continued_tokens", 0) for m in metrics) == continued

    uids, steps = trained(run)
    assert len(uids) == PROMPTS and set(uids.values()) == {1}, uids  # none lost, none twice
    assert steps == list(range(16))  # as an uninterrupted run
    # each step logged once (metrics.jsonl, TensorBoard): what the killed process and the dead trainers logged
    # after their checkpoints is gone (issue 42, item 7)
    assert_each_prompt_and_step_once(tmp_path, prompts=PROMPTS, steps=16)


def test_a_dead_node_holding_the_replicas_heals_on_the_spare_node(request, tmp_path, tiny_model_dir, train_file):
    """Head: the trainer, queue and Rollouter (what does not heal); two rollout nodes: the replicas' bundle on one,
    the other spare. The node holding the replicas dies (its raylet and workers killed): Ray moves the bundle to the
    spare node, the replicas restart there and rejoin; the run trains every prompt once."""
    if ran_in_a_fresh_process(request):  # this drill's driver joins a cluster of its own: no other Ray in its process
        return
    from ray.cluster_utils import Cluster
    import ray

    from verl_async.config import compose, validate
    from verl_async.pipeline import run as run_pipeline

    if ray.is_initialized():  # the session's local Ray (tests/conftest.py ray_session): this drill joins a cluster
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"trainer_node": 1, "rollout_node": 1}, "include_dashboard": False})
    try:
        workers = [cluster.add_node(num_cpus=1, resources={"rollout_node": 1}) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        cfg = validate(compose(overrides=[
            f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={train_file}", "data.val_files=null",
            "data.max_prompt_length=64", "data.max_response_length=48", "actor_rollout_ref.rollout.ignore_eos=true",
            "actor_rollout_ref.rollout.max_num_seqs=1", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "rollout.n_gpus_per_node=2", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.logger=[file]", f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.node_resource=trainer_node", "rollout.node_resource=rollout_node",
        ]))
        outcome: dict = {}
        thread = threading.Thread(target=lambda: outcome.update(summary=run_pipeline(cfg)), daemon=True)
        thread.start()
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.2)
        holding = _node_of_the_replicas(workers)
        assert holding is not None, "the replicas' bundle is on no worker node"
        # the Rollouter (whose death does not heal) runs on the head: the driver's node, where Ray puts it first
        assert _node_of_actor("RolloutService") != holding.node_id, "the Rollouter shares the replicas' node"
        cluster.remove_node(holding, allow_graceful=False)
        thread.join(timeout=400)
        assert not thread.is_alive() and "summary" in outcome, "the run did not finish"
        summary = outcome["summary"]
        assert summary["trainer/steps"] == 16 and summary["fault/replica_restarts"] >= 1
        assert summary["fault/replicas_retired"] == 0 and summary["fault/replica_rejoin_s_max"] > 0
        uids, steps = trained(tmp_path / "run")
        assert len(uids) == PROMPTS and set(uids.values()) == {1} and steps == list(range(16))
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_of_actor(class_name: str):
    from ray._private.state import actors  # the GCS's actor table (the state API needs a dashboard)

    return next((a["Address"]["NodeID"] for a in actors().values()
                 if a.get("ActorClassName", "").endswith(class_name) and a.get("State") == "ALIVE"), None)


def _node_of_the_replicas(workers):
    """The worker node whose raylet hosts the rollout placement group's bundle (its two replicas)."""
    from ray.util import placement_group_table

    for pg in placement_group_table().values():
        if pg.get("state") == "CREATED" and any("rollout_node" in b for b in pg["bundles"].values()):
            node_ids = set(pg["bundles_to_node_id"].values())
            for node in workers:
                if node.node_id in node_ids:
                    return node
    return None
