"""The same run on a two-node Ray cluster (two raylets on this machine, token auth on): the trainer on one
node, the rollout on the other, killed and resumed through the real entry point; every output under the
one run folder and every prompt trained exactly once. The cluster is this test's own (its own ports,
temp folder and token); only the processes it started are stopped."""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from verl_async.data import builtin, write_rows

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
NODES = {"trainer-node": "trainer_node", "rollout-node": "rollout_node"}  # --node-name: its custom resource


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class TwoNodeCluster:
    """`ray start --head` and `ray start --address` under one private folder; `stop()` ends what they started."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.groups: list[int] = []  # the process groups of its `ray start`s

    def start(self) -> None:
        root = self.root
        token = os.path.join(root, "token")
        with open(token, "w") as f:
            f.write(os.urandom(32).hex())
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token, RAY_DEDUP_LOGS="0",
                        RAY_USAGE_STATS_ENABLED="0")
        self.gcs, client, dashboard, agent_head, agent_worker = free_ports(5)
        self.address = f"127.0.0.1:{self.gcs}"
        common = ["--num-cpus=2", "--object-store-memory=100000000", "--disable-usage-stats"]
        head = ["--head", f"--port={self.gcs}", f"--ray-client-server-port={client}", "--include-dashboard=false",
                f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={agent_head}"]
        # one log monitor per host (Ray's advice): the head's already forwards this host's worker logs
        worker = [f"--address={self.address}", f"--dashboard-agent-listen-port={agent_worker}",
                  "--include-log-monitor=false"]
        for (name, resource), role in zip(NODES.items(), (head, worker)):
            cwd = os.path.join(root, name)  # a node's working directory: a relative path sent raw would land here
            os.makedirs(cwd)
            # a session of its own: the daemons `ray start` leaves behind keep its process group, which stop() ends
            start = subprocess.Popen([RAY, "start", *role, *common, f"--node-name={name}",
                                      f"--temp-dir={root}/{name}-ray", f"--resources={json.dumps({resource: 1})}"],
                                     cwd=cwd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
            self.groups.append(start.pid)
            output = start.communicate(timeout=90)[0]
            assert start.returncode == 0, output[-3000:]

    def node_cwds(self) -> list[str]:
        return [os.path.join(self.root, name) for name in NODES]

    def processes(self) -> list:
        """Every process of this cluster: in the process groups of its `ray start`s, or naming its folder, and
        all they started (Ray renames its workers)."""
        import psutil

        found = {}
        for proc in psutil.process_iter(["cmdline"]):
            try:
                ours = os.getpgid(proc.pid) in self.groups or any(self.root in a for a in proc.info["cmdline"] or ())
                if ours:
                    for p in [proc, *proc.children(recursive=True)]:
                        found[p.pid] = p
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
        return list(found.values())

    def stop(self) -> None:
        procs = self.processes()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in procs:
                _send(p, sig)
            procs = _wait_gone(procs, timeout_s=3)


def _send(proc, sig: int) -> None:
    import psutil

    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def _wait_gone(procs: list, timeout_s: float) -> list:
    """The processes still running after at most `timeout_s` (a zombie no one reaps counts as gone)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)
        procs = alive


@pytest.fixture(scope="module")
def cluster():
    root = tempfile.mkdtemp(prefix="vac-", dir="/tmp")  # short: Ray's socket paths live under it
    nodes = TwoNodeCluster(root)
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rows = builtin.generate_rows("train", 16, seed=3)
    write_rows(rows, str(folder / "train.parquet"))
    return str(folder / "train.parquet")


def test_a_run_split_over_two_nodes_keeps_its_outputs_in_one_folder_and_resumes_exactly_once(
        cluster, tmp_path, tiny_model_dir, data_files):
    driver = tmp_path / "driver"  # the driver's cwd: the relative run folder below is resolved here, once
    driver.mkdir()
    args = [
        sys.executable, "-m", "recipe.fully_async_main",
        f"ray_init.address={cluster.address}",
        "trainer.node_resource=trainer_node", "rollout.node_resource=rollout_node",
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={data_files}", "data.val_files=null",
        "data.max_prompt_length=64", "data.max_response_length=12", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.max_num_seqs=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "rollout.total_rollout_steps=16", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.logger=[tensorboard]", "trainer.default_local_dir=run", "trainer.save_freq=1",
        "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1",
        f"hydra.run.dir={tmp_path / 'hydra'}",  # Hydra's own log folder (README: where it goes by default)
    ]
    env = dict(cluster.env, PYTHONPATH=REPO)
    run = driver / "run"
    log = tmp_path / "first.log"  # a file, not a pipe nobody reads while it runs
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=driver, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    # meanwhile, a driver without the cluster's token: one line, within seconds, naming the address and the fix
    no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    refused = subprocess.run(args, cwd=driver, env=no_token, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and time.monotonic() - t0 < 30, refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines()[-1].startswith(
        f"config error: ray_init.address: {cluster.address}: the cluster has token authentication on and this "
        "driver sent no token; set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH"), refused.stderr[-2000:]

    marker = run / "global_step_2" / "actor" / "meta.json"
    deadline = time.time() + 90
    while time.time() < deadline and not marker.exists() and proc.poll() is None:
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended by itself (then the assert below says why)
        pass
    proc.wait(timeout=30)
    first = log.read_text()
    assert marker.exists(), "no checkpoint before the deadline:\n" + first[-3000:]
    placed = re.search(r"^placement: (.*)$", first, re.M)
    assert placed, first[-3000:]
    assert re.fullmatch(r"trainer rank 0 on node trainer-node \(id \w+\); rollout replica 0 on node rollout-node "
                        r"\(id \w+\)", placed.group(1)), placed.group(0)

    resumed = subprocess.run(args, cwd=driver, env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    said = re.search(rf"resuming from {re.escape(str(run))}/global_step_(\d+)/actor \(step (\d+) of 8\)", resumed.stdout)
    assert said, resumed.stdout[-3000:]
    k = int(said.group(2))
    assert k >= 2 and f"{8 - k} steps trained (resumed at step {k}, now at step 8)" in resumed.stdout

    with open(run / "trained_uids.jsonl") as f:
        uids = [u for line in f if line.strip() for u in json.loads(line)["uids"]]
    counts = collections.Counter(uids)
    assert len(counts) == 16 and set(counts.values()) == {1}, counts
    # every output in the one run folder the driver named; nothing beside it, nothing under the nodes' cwds
    assert sorted(os.listdir(driver)) == ["run"]
    for name in ("config.yaml", "trained_uids.jsonl", "timeline.jsonl", "timeline.html", "latest_checkpointed_iteration.txt",
                 "rollout/lengths.jsonl", "global_step_8/actor/meta.json"):
        assert (run / name).exists(), name
    assert any(f.startswith("events") for f in os.listdir(run / "tensorboard"))
    assert not (run / ".verl_async_nodes").exists() or not os.listdir(run / ".verl_async_nodes")
    assert all(os.listdir(cwd) == [] for cwd in cluster.node_cwds())
