"""Fault drills on CPU (docs/healing.md): real processes killed with SIGKILL under `python -m recipe.fully_async_main`.

One run takes every process fault at once: an engine replica dies in the middle of a request
(`debug.fail_replicas=['0:die@N']`), a trainer rank dies in the middle of an update and the Trainer
actor dies during a sync (`debug.fail_trainer`). It heals from each; then the whole run is killed
(`kill -9` of its process group, as by hand) after a later checkpoint and started again with the same
command, which continues the responses that checkpoint held in flight. Across both, every prompt is
trained exactly once and the steps are those of an uninterrupted run. A second drill kills a whole
Ray node (ray.cluster_utils) that holds the engine replicas: they restart on the spare node and rejoin.
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

from verl_async.data import builtin, write_rows

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = 32  # 16 steps of 2 groups, a sync every 2 steps: versions 1..8


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    write_rows(builtin.generate_rows("train", PROMPTS, seed=3), str(path))
    return str(path)


def trained(run_dir) -> tuple[collections.Counter, list[int]]:
    uids, steps = collections.Counter(), []
    with open(os.path.join(run_dir, "trained_uids.jsonl")) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                steps.append(record["step"])
                uids.update(record["uids"])
    return uids, steps


def test_a_run_heals_from_a_dead_replica_rank_and_trainer_and_a_kill_resumes_its_partial_responses(
        tmp_path, tiny_model_dir, train_file):
    run = tmp_path / "run"
    args = [
        sys.executable, "-m", "recipe.fully_async_main", f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={train_file}", "data.val_files=null", "data.max_prompt_length=64",
        "data.max_response_length=48", "actor_rollout_ref.rollout.ignore_eos=true",
        # one sequence per replica at a time: generation is the slow side, so a sync always finds requests in flight
        "actor_rollout_ref.rollout.max_num_seqs=1", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "rollout.n_gpus_per_node=2", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.logger=[console,file]", "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=3", f"trainer.default_local_dir={run}", "ray_init.num_cpus=2",
        "debug.fail_replicas=['0:die@5']", "debug.fail_trainer=[rank0:die@update3,actor:die@sync4]",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    env = dict(os.environ, PYTHONPATH=REPO)
    marker = run / "global_step_7" / "actor" / "meta.json"
    first_log = tmp_path / "first.log"
    with open(first_log, "w") as out:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 400
    while time.time() < deadline and not marker.exists() and proc.poll() is None:
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole run, as kill -9 by hand
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)
    first = first_log.read_text()
    assert marker.exists(), first[-4000:]
    # the replica: lost in its 5th request, restarted in its bundle, back with the current weights
    assert re.search(r"engine replica 0 rejoined [\d.]+ s after it was lost, with the weights of version \d+", first), \
        first[-4000:]
    # the trainer: rank 0 died in the update of step 3 (checkpoint of version 1 = step 2), the actor in the sync
    # to version 4 (after its weights reached the engines, before that checkpoint: back to version 3 = step 6)
    healed = re.findall(r"^healed: the trainer restarted from (\S+) at step (\d+) in ([\d.]+) s; (\d+) group\(s\)",
                        first, re.M)
    assert [(os.path.basename(os.path.dirname(p)), int(s)) for p, s, _, _ in healed] == \
        [("global_step_1", 2), ("global_step_3", 6)], first[-4000:]
    assert [int(g) for *_, g in healed] == [2, 4]  # step 3's groups; steps 7 and 8's
    metrics = [json.loads(line)["data"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert max(m.get("fault/trainer_restarts", 0) for m in metrics) == 2
    assert all(m["fault/trainer_recovery_s"] > 0 for m in metrics if "fault/trainer_recovery_s" in m)
    assert max(m.get("fault/replica_restarts", 0) for m in metrics) >= 1

    resumed = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    out = resumed.stdout
    assert f"resuming from {run}/global_step_7/actor (step 14 of 16)" in out, out[-3000:]
    said = re.search(r"^resume: (\d+) response\(s\) in flight at the checkpoint continued \((\d+) of its (\d+) tokens\), "
                     r"(\d+) token\(s\) regenerated$", out, re.M)
    assert said, out[-3000:]
    responses, continued, saved, regenerated = map(int, said.groups())
    assert responses >= 1 and continued == saved > 0 and regenerated == 0
    assert "2 steps trained (resumed at step 14, now at step 16), version 8" in out

    uids, steps = trained(run)
    assert len(uids) == PROMPTS and set(uids.values()) == {1}, uids  # none lost, none twice
    assert steps == list(range(16))  # as an uninterrupted run


def test_a_dead_node_holding_the_replicas_heals_on_the_spare_node(tmp_path, tiny_model_dir, train_file):
    """Head: the trainer, queue and Rollouter (what does not heal); two rollout nodes: the replicas' bundle on one,
    the other spare. The node holding the replicas dies (its raylet and workers killed): Ray moves the bundle to the
    spare node, the replicas restart there and rejoin; the run trains every prompt once."""
    from ray.cluster_utils import Cluster
    import ray

    from verl_async.config import compose, validate
    from verl_async.pipeline import run as run_pipeline

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
