"""Engine replicas as Ray actors, and the proxy that makes one look like a local engine.

Each replica owns its devices (rollout.tensor_model_parallel_size of them; a CPU share on
CPU). `RemoteEngine` implements the InferenceEngine interface by forwarding to the actor,
so the Rollouter's scheduling code is the same for in-process engines (tests) and for
replicas on their own GPUs.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import ray

from verl_async.config.derived import START_TIMEOUT_KEY
from verl_async.placement import NodePlan, Reservation, resources_of
from verl_async.rollout.engine import EngineStats, GenerateRequest, GenerateResult, InferenceEngine
from verl_async.rollout.faults import FailReplicas, with_faults
from verl_async.rollout.health import ReplicaLost
from verl_async.rollout.registry import build_engine_from_config
from verl_async.sync import engine_weight_sync, rollout_weight_sync
from verl_async.sync.buckets import tensor_checksum
from verl_async.utils import device as device_layer
from verl_async.utils.preimport import import_model_stack
from verl_async.utils.shared_dirs import SharedDir, verify_here
from verl_async.utils.startup import StartupClock
from verl_async.utils.threads import set_torch_threads
from verl_async.utils.waiting import WaitTimeout, finished_in_turn, resolve


@dataclass(frozen=True)
class ReplicaSpec:
    """What every engine replica of a run is built from; a replica adds only its index and overrides.

    `shared_devices`: accelerator ids the replicas share with the trainer (`rollout.colocate=true`);
    replica i pins ids[i*tp:(i+1)*tp] and asks Ray for none. `fail_replicas`: debug.fail_replicas
    (rollout/faults.py), the replicas whose every request fails (tests, drills). `shared_dirs`:
    folders the replica's node must see (utils/shared_dirs.py), checked before the model loads.
    """

    rollout_cfg: Mapping[str, Any]
    model_path: str
    device: str
    trust_remote_code: bool = False
    override_config: Optional[Mapping[str, Any]] = None
    shared_devices: Optional[Sequence[str]] = None
    fail_replicas: FailReplicas = None
    shared_dirs: Sequence[SharedDir] = ()
    cpu_threads: Optional[int] = None  # torch threads on CPU: the replica's share of the cores (config/derived.py)


class ReplicaFenced(RuntimeError):
    """A restarted replica holds the model's first weights: it serves no request until it has the current ones."""


def _restarted() -> bool:
    """Whether Ray restarted this actor (rollout.max_replica_restarts); False outside an actor."""
    import warnings

    try:
        with warnings.catch_warnings():  # Ray's own lookup behind it warns about an internal call
            warnings.simplefilter("ignore")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - in-process (tests): a first start
        return False


class EngineReplica:
    """Plain class behind the replica actor: builds the configured engine on this process's device.

    After a restart (Ray re-runs `__init__` in the same placement bundle) the engine holds the
    model's first weights, so the replica is fenced: `generate` raises `ReplicaFenced` until the
    healer (rollout/healing.py) has loaded the current weights and called `rejoin`. Each process
    has its own `incarnation`, so the healer can tell a restarted replica from the one it lost.
    """

    def __init__(self, spec: ReplicaSpec, index: int = 0,
                 engine_overrides: Optional[Mapping[str, Any]] = None) -> None:
        self.startup = StartupClock()  # utils/startup.py: the Rollouter writes this replica's lane
        self.incarnation_id = uuid.uuid4().hex
        self.restarted = _restarted()
        self.fenced = self.restarted
        if not self.restarted:  # the start checked the node; the driver's markers are gone by a restart
            verify_here(spec.shared_dirs, f"engine replica {index}")
        device = spec.device
        shared = list(spec.shared_devices or [])
        if shared and device != "cpu":  # before the first accelerator call of this process
            tp = int(spec.rollout_cfg.get("tensor_model_parallel_size", 1) or 1)
            mine = shared[index * tp:(index + 1) * tp]
            if len(mine) < tp:
                raise ValueError(f"shared devices {','.join(shared)} have no {tp} device(s) for replica {index}")
            os.environ[device_layer.visible_devices_env(device)] = ",".join(mine)
        model_stack = import_model_stack(spec.model_path)  # beside the device's context (utils/preimport.py)
        with self.startup.phase("device"):  # the accelerator's context is made here
            device_spec = device_layer.resolve(device)
            device_spec.set_current()
        set_torch_threads(spec.cpu_threads if device == "cpu" else None)
        with self.startup.phase("model_imports"):  # what is left of transformers' model stack
            model_stack.wait()
        self.index = index
        built = time.time()
        engine = build_engine_from_config(
            spec.rollout_cfg,
            model_path=spec.model_path,
            device=str(device_spec.torch_device),
            trust_remote_code=spec.trust_remote_code,
            override_config=spec.override_config,
            **dict(engine_overrides or {}),
        )
        # the engine's own steps (the native engine: model_load, engine_build), else the whole build
        self.startup.add(getattr(engine, "startup_phases", None) or [("engine", built, time.time())])
        # debug.fail_replicas (rollout/faults.py); else unchanged
        self.engine = with_faults(engine, index, spec.fail_replicas, life=int(self.restarted))

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.fenced:
            raise ReplicaFenced(f"engine replica {self.index} restarted and has no current weights yet")
        return await self.engine.generate(request)

    def incarnation(self) -> str:
        """This process's id: a different one after Ray restarted the replica."""
        return self.incarnation_id

    def rejoin(self) -> int:
        """The healer loaded the current weights: serve again. Returns the engine's weight version."""
        self.fenced = False
        return self.engine.version

    async def abort(self, request_ids: Optional[list[str]] = None) -> None:
        await self.engine.abort(request_ids)

    async def weight_sync(self, transport: str, step: str, *args: Any, **kwargs: Any) -> Any:
        """The one call weight sync makes on a replica: `step` of this engine's half of `transport` (verl_async/sync/)."""
        return await engine_weight_sync(self.engine, transport, step, *args, **kwargs)

    def loaded_checksums(self) -> dict[str, str]:
        """Checksum of every parameter of the engine's model (engines exposing `.model`; tests, sync checks)."""
        model = getattr(self.engine, "model", None)
        if model is None:
            return {}
        return {n: tensor_checksum(p.data) for n, p in model.named_parameters()}

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def profile(self) -> dict[str, float]:
        """The engine's cumulative step counters (prefill / decode steps, rows, seconds); {} if it keeps none."""
        profile = getattr(self.engine, "profile", None)
        return dict(profile()) if callable(profile) else {}

    def version(self) -> int:
        return self.engine.version

    async def ready(self) -> int:
        """Finish engines that start inside the event loop (vLLM's AsyncLLM); returns the weight version."""
        start = getattr(self.engine, "start", None)
        if start is not None:
            t0 = time.time()
            await start()
            self.startup.phases.append(("engine_start", t0, time.time()))
        return self.engine.version

    def startup_report(self) -> dict[str, Any]:
        """This replica's start-up phases (utils/startup.py)."""
        return self.startup.report()

    async def shutdown(self) -> None:
        await self.engine.shutdown()


def lost_reason(exc: BaseException) -> str:
    """One line of Ray's actor error: its type and first sentence (the rest is Ray's troubleshooting text)."""
    first = " ".join(str(exc).split()).split(". ")[0][:300]
    return f"{type(exc).__name__}: {first}"


class RemoteEngine(InferenceEngine):
    """An InferenceEngine whose work happens in an `EngineReplica` actor.

    A dead, restarting or restarted replica raises `ReplicaLost` (rollout/health.py) from every
    call instead of Ray's actor errors; an exception the engine raised inside `generate` comes back
    as a request error, as an engine reports a failed request.
    """

    def __init__(self, handle: Any, index: int = 0, incarnation: Optional[str] = None) -> None:
        self.handle = handle
        self.index = index
        self.incarnation = incarnation  # the replica process this proxy was made for (None: not asked)
        self._version = -1

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await getattr(self.handle, method).remote(*args, **kwargs)
        except ray.exceptions.RayActorError as exc:
            raise ReplicaLost(self.index, lost_reason(exc)) from None
        except ray.exceptions.RayTaskError as exc:
            if isinstance(getattr(exc, "cause", None), ReplicaFenced):
                raise ReplicaLost(self.index, "it restarted and waits for the current weights", restarted=True) \
                    from None
            raise

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        try:
            return await self._call("generate", request)
        except ray.exceptions.RayTaskError as exc:  # the engine raised: a failed request, the replica may serve on
            cause = getattr(exc, "cause", None) or exc
            return GenerateResult(request.request_id, list(request.prefix_token_ids), list(request.prefix_log_probs),
                                  list(request.prefix_versions), "abort",
                                  error=f"{type(cause).__name__}: {' '.join(str(cause).split())[:500]}")

    async def abort(self, request_ids: Optional[Sequence[str]] = None) -> None:
        await self._call("abort", None if request_ids is None else list(request_ids))

    async def update_weights(self, named_tensors: Iterable[Any], version: int) -> None:
        """Buckets (or ObjectRefs of buckets) go to the actor by reference, fetched there one by one."""
        refs = [item if isinstance(item, ray.ObjectRef) else ray.put(item) for item in named_tensors]
        await self.weight_sync("object_store", "load", refs, version=version)

    async def weight_sync(self, transport: str, step: str, *args: Any, **kwargs: Any) -> Any:
        """Forward a weight-sync step to the replica actor; a step that loads weights names its `version`."""
        out = await self._call("weight_sync", transport, step, *args, **kwargs)
        if "version" in kwargs:
            self._version = int(kwargs["version"])
        return out

    async def rejoin(self) -> int:
        """Serve again (the current weights are loaded); the replica's weight version."""
        return int(await self._call("rejoin"))

    async def pause(self) -> None:
        await self._call("pause")

    async def resume(self) -> None:
        await self._call("resume")

    def stats(self) -> EngineStats:
        return resolve(self.handle.stats.remote(), 60)

    async def stats_async(self) -> EngineStats:
        return await self.handle.stats.remote()

    @property
    def version(self) -> int:
        return self._version

    async def shutdown(self) -> None:
        await self._call("shutdown")


def replica_actor_options(
    device: str, tensor_parallel_size: int, cpu_share: float = 0.25, colocated: bool = False
) -> dict[str, Any]:
    """Ray resources for one replica: its accelerators, or a small CPU share (never a big reservation)."""
    if device != "cpu" and colocated:
        return {"num_cpus": 1}  # the devices are the trainer's; the replica pins its share itself
    if device == "cuda":
        return {"num_gpus": tensor_parallel_size, "num_cpus": 1}
    if device == "npu":
        return {"resources": {device_layer.ray_resource_name("npu"): tensor_parallel_size}, "num_cpus": 1}
    return {"num_cpus": cpu_share}


class ReplicaStartTimeout(TimeoutError):
    """Engine replicas did not load the model within rollout.start_timeout_s; the message names them and the key."""


def rollout_node_plan(nnodes: int, n_gpus_per_node: int, device: str, tensor_parallel_size: int,
                      node_resource: Optional[str] = None) -> NodePlan:
    """rollout.nnodes nodes of rollout.n_gpus_per_node / tensor_model_parallel_size replicas each
    (a replica's devices are on one node)."""
    member = resources_of(replica_actor_options(device, tensor_parallel_size))
    return NodePlan("rollout", nnodes, n_gpus_per_node // tensor_parallel_size, member, node_resource)


def start_replicas(
    count: int,
    spec: ReplicaSpec,
    *,
    timeout_s: float,
    engine_overrides: Optional[Sequence[Mapping[str, Any]]] = None,
    placement: Optional[Reservation] = None,
    max_restarts: int = 0,
) -> list[RemoteEngine]:
    """Start `count` replica actors and wait until each has loaded its model (`timeout_s`: rollout.start_timeout_s,
    config/derived.py replica_start_timeout_s).

    `engine_overrides[i]`: engine keyword arguments for replica i only (P-DSR: a fast
    replica's larger max_num_seqs). `placement`: replica i runs in its bundle (rollout_node_plan);
    without one Ray places the replicas. `max_restarts` (rollout.max_replica_restarts): Ray restarts
    a replica whose process died this often, in its bundle (rollout/healing.py takes it from there).
    """
    return await_replicas(launch_replicas(count, spec, engine_overrides=engine_overrides, placement=placement,
                                          max_restarts=max_restarts), timeout_s)


def launch_replicas(
    count: int,
    spec: ReplicaSpec,
    *,
    engine_overrides: Optional[Sequence[Mapping[str, Any]]] = None,
    placement: Optional[Reservation] = None,
    max_restarts: int = 0,
) -> list[Any]:
    """Create the replica actors and return their handles at once: each starts its process and loads its model
    while the caller prepares the rest (the Rollouter its tokenizer, data and reward). `await_replicas` waits."""
    tp = int(spec.rollout_cfg.get("tensor_model_parallel_size", 1) or 1)
    if engine_overrides is not None and len(engine_overrides) != count:
        raise ValueError(f"engine_overrides has {len(engine_overrides)} entries for {count} replicas")
    actor_cls = ray.remote(EngineReplica)
    run_tag = uuid.uuid4().hex[:8]  # names show up in `ray list actors` and let operators find a replica
    return [
        actor_cls.options(
            max_concurrency=1000, name=f"verl_async_replica{i}_{run_tag}",
            max_restarts=int(max_restarts), max_task_retries=0,
            **replica_actor_options(spec.device, tp, colocated=bool(spec.shared_devices)),
            **({} if placement is None else {"scheduling_strategy": placement.strategy(i)}),
        ).remote(spec, i, engine_overrides[i] if engine_overrides is not None else None)
        for i in range(count)
    ]


def await_replicas(handles: Sequence[Any], timeout_s: float) -> list[RemoteEngine]:
    """Wait until every launched replica has loaded its model; after `timeout_s` kill them all and raise
    ReplicaStartTimeout naming the late ones."""
    count = len(handles)
    try:
        for _, ref, left in finished_in_turn({f"replica {i}": h.ready.remote() for i, h in enumerate(handles)},
                                             timeout_s):
            resolve(ref, left)  # not ray.get: this runs in the Rollouter's (async) actor
    except WaitTimeout as late:
        kill_replicas(handles)  # none is left loading or holding devices
        raise ReplicaStartTimeout(f"{', '.join(late.pending)} of {count} engine replica(s) did not load the model "
                                  f"and start within {timeout_s:g} s (stuck or dead; raise {START_TIMEOUT_KEY} if only "
                                  "slow)") from None
    lives = ray.get([h.incarnation.remote() for h in handles], timeout=timeout_s)
    return [RemoteEngine(h, i, life) for i, (h, life) in enumerate(zip(handles, lives))]


async def restart_replica(engine: RemoteEngine, *, kill: bool, timeout_s: float, poll_s: float = 0.5) -> RemoteEngine:
    """The replica's next process, with its model loaded: a proxy for it (rollout/healing.py).

    Ray restarts a replica actor whose process died (start_replicas' `max_restarts`), in the same
    placement bundle; `kill`: the process still runs (broken, hung), so it is killed first and Ray
    restarts it the same way. A replica Ray will not restart (its restarts used up) raises Ray's
    ActorDiedError; one that does not answer with a new process within `timeout_s`
    (rollout.start_timeout_s) raises ReplicaStartTimeout.
    """
    handle = engine.handle
    if kill:
        ray.kill(handle, no_restart=False)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise ReplicaStartTimeout(f"engine replica {engine.index} did not restart within {timeout_s:g} s (raise "
                                      f"{START_TIMEOUT_KEY} if it is only slow)")
        try:
            life = await asyncio.wait_for(handle.incarnation.remote(), left)
        except ray.exceptions.ActorUnavailableError:  # dying or restarting: ask again
            await asyncio.sleep(poll_s)
            continue
        except asyncio.TimeoutError:
            continue
        if life != engine.incarnation:
            break
        await asyncio.sleep(poll_s / 2)  # the old process still answers: the kill has not landed yet
    await asyncio.wait_for(handle.ready.remote(), max(1.0, deadline - loop.time()))
    return RemoteEngine(handle, engine.index, life)


def end_replica(engine: RemoteEngine) -> None:
    """End a retired replica for good (Ray does not restart it)."""
    ray.kill(engine.handle, no_restart=True)


def kill_replicas(handles: Sequence[Any]) -> None:
    for handle in handles:
        try:
            ray.kill(handle)
        except Exception:  # noqa: BLE001 - already dead
            pass


class SyncTarget:
    """Replicas that only receive weights: the rollout side of a sync without a Rollouter.

    A sync driver needs pause/resume and the fan-out to the replicas (`weight_sync`, as the
    RolloutService has them); sync checks and benchmarks (scripts/check_sync_gpu.py, tests)
    wrap this class in a Ray actor.
    """

    def __init__(self, count: int, rollout_cfg: Mapping[str, Any], model_path: str, device: str, *,
                 timeout_s: float = 600, **spec: Any) -> None:
        self.sync_engines = start_replicas(count, ReplicaSpec(rollout_cfg, model_path, device, **spec),
                                           timeout_s=timeout_s)
        self.pauses = 0
        self.version = -1

    async def pause_for_sync(self) -> None:
        self.pauses += 1

    async def resume_after_sync(self, version: int) -> None:
        self.version = version

    async def weight_sync(self, transport: str, step: str, *args: Any, **kwargs: Any) -> Any:
        return await rollout_weight_sync(self, transport, step, *args, **kwargs)

    def state(self) -> tuple[int, int]:
        return self.pauses, self.version

    async def loaded_checksums(self) -> dict[str, dict[str, str]]:
        """Per replica: checksum of every parameter its engine holds now (tests, sync checks)."""
        sums = await asyncio.gather(*(e.handle.loaded_checksums.remote() for e in self.sync_engines))
        return {f"replica {i}": s for i, s in enumerate(sums)}

    def kill_replica(self, index: int) -> None:
        ray.kill(self.sync_engines[index].handle)
