"""Running on a Ray cluster, the parts that need no cluster: paths decided on the driver, the folders
nodes must share, placement plans against a cluster's nodes, and attach failures in one line, in seconds."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent import futures

import pytest

from verl_async.config import ConfigError, compose, validate
from verl_async.config.ray_address import _token_metadata, check_ray_address, probe
from verl_async.config.run_paths import CACHE_KEY, RUN_DIR_KEY, absolute_paths, shared_folders
from verl_async.errors import root_cause
from verl_async.placement import NodePlan, PlacementError, resources_of
from verl_async.utils import shared_dirs

A = "actor_rollout_ref"


def config(*overrides: str):
    return validate(compose(overrides=list(overrides)))


# --------------------------------------------------------------------------- paths
def test_every_path_an_actor_sees_is_absolute_against_the_drivers_cwd(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reward.py").write_text("def compute_score(*a, **k):\n    return 0.0\n")
    os.symlink(tiny_model_dir, tmp_path / "model")
    cfg = absolute_paths(config(f"{A}.model.path=model", "trainer.default_local_dir=out/run",
                                "custom_reward_function.path=reward.py", "debug.save_rollout_data='dump/r_{rollout_id}.pt'"))
    assert cfg.trainer.default_local_dir == str(tmp_path / "out" / "run")
    assert cfg.actor_rollout_ref.model.path == str(tmp_path / "model")
    assert cfg.custom_reward_function.path == str(tmp_path / "reward.py")
    assert cfg.debug.save_rollout_data == str(tmp_path / "dump" / "r_{rollout_id}.pt")  # the pattern survives
    # builtin:// data is built on the driver and handed on as the parquet files it became
    assert all(os.path.isabs(p) and p.endswith(".parquet") and os.path.exists(p) for p in cfg.data.train_files)


def test_hub_ids_and_builtin_models_stay_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(config(f"{A}.model.path=Qwen/Qwen2.5-0.5B-Instruct", "data.val_files=null"))
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.data.val_files is None
    assert absolute_paths(config()).actor_rollout_ref.model.path == "builtin://tiny"  # resolved by the pipeline


def test_the_cache_is_shared_only_when_the_run_takes_something_from_it(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("VERL_ASYNC_CACHE", str(tmp_path / "cache"))
    train = tmp_path / "train.parquet"
    train.write_bytes(b"")
    own = absolute_paths(config(f"{A}.model.path={tiny_model_dir}", f"data.train_files={train}", "data.val_files=null",
                                f"trainer.default_local_dir={tmp_path / 'run'}"))
    assert shared_folders(own) == {RUN_DIR_KEY: str(tmp_path / "run")}
    from_cache = absolute_paths(config(f"{A}.model.path={tiny_model_dir}", f"trainer.default_local_dir={tmp_path / 'run'}"))
    assert shared_folders(from_cache) == {RUN_DIR_KEY: str(tmp_path / "run"), CACHE_KEY: str(tmp_path / "cache")}


# --------------------------------------------------------------------------- shared folders
def test_a_node_without_the_drivers_marker_is_named_with_the_key(tmp_path):
    dirs = shared_dirs.mark({RUN_DIR_KEY: str(tmp_path / "run"), CACHE_KEY: str(tmp_path / "cache")})
    assert shared_dirs.problem(dirs, "node 10.0.0.2") is None
    other = shared_dirs.mark({RUN_DIR_KEY: str(tmp_path / "run")})  # a second run in the same folder
    os.remove(dirs[1].marker)  # as seen from a node that mounts another disk at the cache's path
    found = shared_dirs.problem(dirs, "node 10.0.0.2")
    assert found.startswith(f"{CACHE_KEY}: node 10.0.0.2 does not see {tmp_path / 'cache'} as the driver does")
    assert "\n" not in found and "every node of the run must mount it at the same path" in found
    shared_dirs.unmark(dirs)
    assert shared_dirs.problem(other, "here") is None  # the other run's marker is untouched
    shared_dirs.unmark(other)
    assert os.listdir(tmp_path / "run") == []


# --------------------------------------------------------------------------- placement
def node(cpu: float, gpu: float = 0, **custom: float) -> dict[str, float]:
    return {"CPU": cpu, "GPU": gpu, **custom}


def test_one_bundle_per_node_packed_on_one_node_spread_across_several():
    one = NodePlan("trainer", 1, 4, {"CPU": 1, "GPU": 1})
    assert one.strategy == "STRICT_PACK" and one.bundles() == [{"CPU": 4, "GPU": 4}]
    two = NodePlan("trainer", 2, 4, {"CPU": 1, "GPU": 1}, "trainer")
    assert two.strategy == "STRICT_SPREAD" and two.bundles() == [{"CPU": 4, "GPU": 4, "trainer": 0.001}] * 2
    assert [two.bundle_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # rank 0 on the first node
    with pytest.raises(IndexError):
        two.bundle_of(8)


def test_trainer_and_rollout_plans_carry_each_members_devices():
    from verl_async.rollout.replica import replica_actor_options, rollout_node_plan
    from verl_async.trainer.worker_group import trainer_node_plan

    assert trainer_node_plan("cuda", 2, 8, "trainer").bundle() == {"CPU": 8, "GPU": 8, "trainer": 0.001}
    assert trainer_node_plan("cpu", 1, 2).bundle() == {"CPU": 0.4}
    rollout = rollout_node_plan(2, 8, "cuda", 2, "rollout")  # tensor parallel 2: 4 replicas per node
    assert rollout.per_node == 4 and rollout.bundle() == {"CPU": 4, "GPU": 8, "rollout": 0.001}
    assert resources_of(replica_actor_options("npu", 2)) == {"NPU": 2, "CPU": 1}


@pytest.mark.parametrize("plan,nodes,key,words", [
    (NodePlan("trainer", 1, 1, {"CPU": 1}, "trainer"), [node(8, rollout=1)], "trainer.node_resource",
     "no node of the cluster carries the Ray resource 'trainer'"),
    (NodePlan("rollout", 1, 8, {"CPU": 1, "GPU": 1}), [node(16, 4), node(16, 4)], "rollout.n_gpus_per_node",
     "rollout.n_gpus_per_node=8 needs one node holding {CPU: 8, GPU: 8}, but none of the 2 node(s) does"),
    (NodePlan("trainer", 2, 1, {"CPU": 0.2}, "trainer"), [node(2, trainer=1), node(2, rollout=1)], "trainer.nnodes",
     "trainer.nnodes=2 needs 2 distinct nodes each holding {CPU: 0.2, trainer: 0.001}; the cluster has 1 such "
     "node(s) carrying 'trainer'"),
])
def test_a_plan_no_cluster_node_can_hold_is_one_line_naming_the_key(plan, nodes, key, words):
    found = plan.problem(nodes)
    assert isinstance(found, PlacementError) and found.key == key and words in str(found), found
    assert str(found).startswith(f"{key}: ") and "\n" not in str(found)
    assert plan.problem(nodes + [node(64, 8, trainer=1)] * 2) is None


def test_a_split_layout_on_too_few_devices_is_one_line_not_a_wait(monkeypatch):
    """Each plan fits a one-GPU node alone; together (a split layout: 1 trainer GPU + 1 rollout GPU) they cannot.
    Seen on a GPU machine: the second reservation waited for its timeout with nothing said."""
    from verl_async.placement import plans_problem

    trainer = NodePlan("trainer", 1, 1, {"CPU": 1, "GPU": 1})
    rollout = NodePlan("rollout", 1, 1, {"CPU": 1, "GPU": 1})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    found = plans_problem([trainer, rollout], [node(16, 1)])
    assert isinstance(found, PlacementError) and "\n" not in str(found), found
    assert str(found).startswith("trainer.nnodes x trainer.n_gpus_per_node + rollout.nnodes x rollout.n_gpus_per_node: ")
    assert "need {GPU: 2} together, but the cluster has {GPU: 1} (CUDA_VISIBLE_DEVICES=0)" in str(found)
    assert "rollout.colocate=true" in str(found)
    assert plans_problem([trainer, rollout], [node(16, 2)]) is None
    assert plans_problem([trainer, rollout], [node(16, 1), node(16, 1)]) is None  # one GPU on each of two nodes
    assert plans_problem([trainer], [node(16, 1)]) is None
    cpu_only = [NodePlan("trainer", 1, 2, {"CPU": 0.2}), NodePlan("rollout", 1, 2, {"CPU": 1})]
    assert plans_problem(cpu_only, [node(2.4, 0)]) is None
    assert "need {CPU: 2.4} together, but the cluster has {CPU: 2}" in str(plans_problem(cpu_only, [node(2, 0)]))


def test_a_replicas_devices_must_fit_one_node():
    assert config("rollout.nnodes=2", "rollout.n_gpus_per_node=2").rollout.nnodes == 2
    with pytest.raises(ConfigError, match=rf"^{A}\.rollout\.tensor_model_parallel_size: 4 does not divide the "
                                          r"rollout's 2 devices per node"):
        config("rollout.nnodes=2", "rollout.n_gpus_per_node=2", f"{A}.rollout.tensor_model_parallel_size=4")


def test_node_resources_are_config_keys_a_local_ray_carries():
    from verl_async.pipeline import node_resources

    cfg = config("trainer.node_resource=trainer_node", "rollout.node_resource=rollout_node")
    assert node_resources(cfg) == ["rollout_node", "trainer_node"]
    assert node_resources(config()) == []


def test_a_run_without_an_address_starts_its_own_ray_even_where_ray_start_left_a_cluster(monkeypatch, capsys):
    """Ray's bare ray.init() joins the cluster in /tmp/ray/ray_current_cluster (another run's `ray start`, or a
    ray.cluster_utils test beside this one) and then refuses ray_init.num_cpus with a traceback (seen in a drill)."""
    import ray
    import ray._private.services as services

    from verl_async import pipeline

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: "10.0.0.1:6379")
    assert pipeline.ray_init(config("ray_init.num_cpus=2")) is True
    assert calls[0]["address"] == "local" and calls[0]["num_cpus"] == 2
    assert "the cluster `ray start` left on this machine (10.0.0.1:6379) is joined with ray_init.address=auto" in \
        capsys.readouterr().out
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    pipeline.ray_init(config())
    assert calls[1]["address"] == "local" and capsys.readouterr().out == ""


def test_a_local_ray_hands_the_workers_environment_down_and_prestarts_no_workers_unless_asked(monkeypatch, tmp_path):
    """Start-up (issue 37): environment variables alone reach the workers by inheritance (the processes ray.init
    starts copy this one's environment), so no runtime_env. Ray's raylet would start one idle worker per CPU and
    ray.init wait for all of them (9-11 s on a 32-core host): none unless ray_init.prestart_workers=true, and then
    they import ray_init.preload_modules. A runtime_env that is more than variables gets fresh workers only."""
    import ray
    import ray._private.services as services

    from verl_async import pipeline

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("VERL_ASYNC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append((kw, dict(os.environ))))
    monkeypatch.setattr(pipeline, "local_cores", lambda: 32)  # a GPU host's
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    before = dict(os.environ)
    cfg = config("+ray_init.runtime_env.env_vars.MY_FLAG=on")
    pipeline.ray_init(cfg)
    kw, seen = calls[-1]
    assert kw["runtime_env"] is None and kw["_system_config"] == {"prestart_worker_first_driver": False}  # 32 CPUs
    for name, value in pipeline.ray_runtime_env(cfg)["env_vars"].items():
        assert seen[name] == value, name  # what a runtime_env would have given every worker
    assert seen["MY_FLAG"] == "on" and dict(os.environ) == before  # this process's own environment as it was

    pipeline.ray_init(config("ray_init.num_cpus=8"))  # null: Ray's own prestart up to 8 workers to wait for
    assert calls[-1][0]["_system_config"] is None
    monkeypatch.setattr(pipeline, "local_cores", lambda: 4)  # ray_init.num_cpus=32 on 4 cores: 4 started at once
    pipeline.ray_init(config("ray_init.num_cpus=32"))
    assert calls[-1][0]["_system_config"] is None
    pipeline.ray_init(config("ray_init.prestart_workers=false"))
    assert calls[-1][0]["_system_config"] == {"prestart_worker_first_driver": False}
    monkeypatch.setattr(pipeline, "local_cores", lambda: 32)
    pipeline.ray_init(config("ray_init.prestart_workers=true"))
    assert calls[-1][0]["runtime_env"] is None and calls[-1][0]["_system_config"] is None  # Ray's own prestart
    pipeline.ray_init(config("ray_init.prestart_workers=true", "ray_init.preload_modules=[torch]"))
    assert calls[-1][0]["runtime_env"] is None
    assert calls[-1][0]["_system_config"] == {"preload_python_modules": ["torch"]}
    pipeline.ray_init(config("ray_init.preload_modules=[torch]"))  # no prestarted workers: nothing to preload
    assert calls[-1][0]["_system_config"] == {"prestart_worker_first_driver": False}
    # a runtime_env that is more than variables (an interpreter, packages) goes to Ray as before: fresh workers,
    # so none prestarted for nothing
    cfg = config(f"ray_init.runtime_env.py_executable={sys.executable}", "ray_init.prestart_workers=true")
    pipeline.ray_init(cfg)
    assert calls[-1][0]["runtime_env"] == pipeline.ray_runtime_env(cfg)
    assert calls[-1][0]["_system_config"] == {"prestart_worker_first_driver": False}
    assert "VERL_ASYNC_CACHE" not in calls[-1][1] or calls[-1][1]["VERL_ASYNC_CACHE"] == before["VERL_ASYNC_CACHE"]


# --------------------------------------------------------------------------- attach
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_a_wrong_address_fails_in_seconds_naming_the_key_and_the_fix(monkeypatch):
    port = closed_port()
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        check_ray_address(config(f"ray_init.address=127.0.0.1:{port}"))
    assert time.monotonic() - t0 < 5
    assert str(info.value) == (f"ray_init.address: 127.0.0.1:{port}: nothing listens there (connection refused); "
                               f"start the head node with `ray start --head --port={port}` or give the address it printed")
    monkeypatch.setenv("RAY_ADDRESS", f"localhost:{port}")
    with pytest.raises(ConfigError, match=rf"^RAY_ADDRESS: localhost:{port}: nothing listens there"):
        check_ray_address(config())
    monkeypatch.setenv("RAY_ADDRESS", "local")
    check_ray_address(config())  # a local Ray: nothing to join
    assert probe("10.0.0.1").startswith("expected host:port")
    assert probe("no-such-host.invalid:6379").startswith("cannot resolve the host 'no-such-host.invalid'")


@pytest.fixture
def fake_gcs():
    """A gRPC server at a local port whose GetClusterId answers as a cluster with token auth on does."""
    grpc = pytest.importorskip("grpc")

    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: Authentication token is missing or incorrect")

    handler = grpc.method_handlers_generic_handler("ray.rpc.NodeInfoGcsService", {
        "GetClusterId": grpc.unary_unary_rpc_method_handler(deny, request_deserializer=bytes,
                                                            response_serializer=bytes)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


PROBE_TIMED = ("import json, sys, time; from verl_async.config.ray_address import probe; t0 = time.monotonic(); "
               "found = probe(sys.argv[1]); print(json.dumps([found, time.monotonic() - t0]))")


def test_a_driver_without_the_clusters_token_is_told_how_to_get_it(fake_gcs, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    if _token_metadata():  # a test before this one started Ray here: this process holds a token; a fresh one does not
        env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
        fresh = subprocess.run([sys.executable, "-c", PROBE_TIMED, fake_gcs], capture_output=True, text=True,
                               timeout=60, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert fresh.returncode == 0, fresh.stderr[-2000:]
        found, seconds = json.loads(fresh.stdout.strip().splitlines()[-1])
    else:
        t0 = time.monotonic()
        found = probe(fake_gcs)
        seconds = time.monotonic() - t0
    assert seconds < 5
    assert found.startswith("the cluster has token authentication on and this driver sent no token; set "
                            "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH"), found


def test_a_port_that_is_not_a_ray_gcs_says_so():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        found = probe(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=2)
    assert found.startswith(("something answers there, but not a Ray cluster's GCS", "no answer within 2 s")), found


# --------------------------------------------------------------------------- errors
class _InitFailed(Exception):
    """What Ray raises when an actor's __init__ raised: only the text of the traceback(s) survives."""

    actor_init_failed = True


def test_an_actor_that_failed_to_start_is_reported_by_its_innermost_cause():
    text = ("The actor died because of an error raised in its creation task, ray::RolloutService.__init__()\n"
            "  File \"service.py\", line 9, in __init__\n"
            "ray.exceptions.ActorDiedError: The actor died because of an error raised in its creation task, ...\n"
            "  File \"replica.py\", line 3, in __init__\n"
            "verl_async.utils.shared_dirs.SharedDirError: VERL_ASYNC_CACHE: node 10.0.0.2 (id 1a2b3c4d), where engine "
            "replica 1 runs, does not see /c as the driver does")
    assert root_cause(_InitFailed(text)) == ("SharedDirError: VERL_ASYNC_CACHE: node 10.0.0.2 (id 1a2b3c4d), where "
                                             "engine replica 1 runs, does not see /c as the driver does")


def test_the_placement_line_groups_members_by_node():
    from verl_async.placement import where

    nodes = ["node a (id 1)"] * 3 + ["node b (id 2)"]
    assert where("ranks", nodes) == "ranks 0-2 on node a (id 1), rank 3 on node b (id 2)"
    assert where("replicas", ["node a", "node b", "node a"]) == "replicas 0, 2 on node a, replica 1 on node b"


def test_an_actor_on_a_node_without_the_folder_stops_naming_its_node(ray_session, tmp_path):
    """What each actor runs first (the trainer, every rank, the Rollouter, every replica), in a Ray worker."""
    dirs = shared_dirs.mark({RUN_DIR_KEY: str(tmp_path / "run")})
    check = ray_session.remote(num_cpus=0)(shared_dirs.problem_here)
    assert ray_session.get(check.remote(dirs, "engine replica 0"), timeout=60) is None
    os.remove(dirs[0].marker)
    found = ray_session.get(check.remote(dirs, "engine replica 0"), timeout=60)
    assert re.match(rf"{RUN_DIR_KEY}: node [\d.]+ \(id [0-9a-f]{{8}}\), where engine replica 0 runs, does not see "
                    rf"{re.escape(str(tmp_path / 'run'))} as the driver does", found), found
    with pytest.raises(shared_dirs.SharedDirError, match=re.escape(found)):
        ray_session.get(ray_session.remote(num_cpus=0)(shared_dirs.verify_here).remote(dirs, "engine replica 0"),
                        timeout=60)
