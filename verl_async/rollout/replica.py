"""Engine replicas as Ray actors, and the proxy that makes one look like a local engine.

Each replica owns its devices (rollout.tensor_model_parallel_size of them; a CPU share on
CPU). `RemoteEngine` implements the InferenceEngine interface by forwarding to the actor,
so the Rollouter's scheduling code is the same for in-process engines (tests) and for
replicas on their own GPUs.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import ray

from verl_async.rollout.engine import EngineStats, GenerateRequest, GenerateResult, InferenceEngine
from verl_async.rollout.faults import FailReplicas, with_faults
from verl_async.rollout.registry import build_engine_from_config
from verl_async.sync_collective import EngineGroupEndpoint, engine_endpoint
from verl_async.sync_ipc import IpcEndpoint, load_ipc_bucket
from verl_async.utils import device as device_layer


def _buckets_from_refs(refs: Sequence[Any]) -> Iterator[Any]:
    """Fetch weight buckets one at a time (peak extra memory: one bucket)."""
    for ref in refs:
        yield ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref


@dataclass(frozen=True)
class ReplicaSpec:
    """What every engine replica of a run is built from; a replica adds only its index and overrides.

    `shared_devices`: accelerator ids the replicas share with the trainer (`rollout.colocate=true`);
    replica i pins ids[i*tp:(i+1)*tp] and asks Ray for none. `fail_replicas`: debug.fail_replicas
    (rollout/faults.py), the replicas whose every request fails (tests, drills).
    """

    rollout_cfg: Mapping[str, Any]
    model_path: str
    device: str
    trust_remote_code: bool = False
    override_config: Optional[Mapping[str, Any]] = None
    shared_devices: Optional[Sequence[str]] = None
    fail_replicas: FailReplicas = None


class EngineReplica:
    """Plain class behind the replica actor: builds the configured engine on this process's device."""

    def __init__(self, spec: ReplicaSpec, index: int = 0,
                 engine_overrides: Optional[Mapping[str, Any]] = None) -> None:
        device = spec.device
        shared = list(spec.shared_devices or [])
        if shared and device != "cpu":  # before the first accelerator call of this process
            tp = int(spec.rollout_cfg.get("tensor_model_parallel_size", 1) or 1)
            mine = shared[index * tp:(index + 1) * tp]
            if len(mine) < tp:
                raise ValueError(f"shared devices {','.join(shared)} have no {tp} device(s) for replica {index}")
            os.environ[device_layer.visible_devices_env(device)] = ",".join(mine)
        device_spec = device_layer.resolve(device)
        device_spec.set_current()
        self.index = index
        engine = build_engine_from_config(
            spec.rollout_cfg,
            model_path=spec.model_path,
            device=str(device_spec.torch_device),
            trust_remote_code=spec.trust_remote_code,
            override_config=spec.override_config,
            **dict(engine_overrides or {}),
        )
        self.engine = with_faults(engine, index, spec.fail_replicas)  # debug.fail_replicas; else unchanged

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self.engine.generate(request)

    async def abort(self, request_ids: Optional[list[str]] = None) -> None:
        await self.engine.abort(request_ids)

    async def load_buckets(self, refs: list, version: int) -> None:
        await self.engine.update_weights(_buckets_from_refs(refs), version)

    async def load_ipc_bucket(self, payload: dict, version: int) -> dict:
        """cuda_ipc: map trainer rank 0's bucket buffer, load it device to device, release it (sync_ipc.py)."""
        return await load_ipc_bucket(self.engine, payload, version)

    # collective weight sync (verl_async/sync_collective.py): this replica's engine ranks join the group
    async def weight_sync_ranks(self) -> int:
        return await engine_endpoint(self.engine).weight_sync_ranks()

    async def join_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str,
                               timeout_s: float, name: str) -> None:
        await engine_endpoint(self.engine).join_weight_sync(host, port, rank, world_size, backend, timeout_s, name)

    async def receive_weights(self, plan: list, version: int, double_buffer: bool = True,
                              verify: bool = False) -> dict:
        return await engine_endpoint(self.engine).receive_weights(plan, version, double_buffer=double_buffer,
                                                                  verify=verify)

    async def leave_weight_sync(self) -> None:
        await engine_endpoint(self.engine).leave_weight_sync()

    def loaded_checksums(self) -> dict[str, str]:
        """Checksum of every parameter of the engine's model (engines exposing `.model`; tests, sync checks)."""
        from verl_async.bucket_plan import tensor_checksum

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

    def version(self) -> int:
        return self.engine.version

    async def ready(self) -> int:
        """Finish engines that start inside the event loop (vLLM's AsyncLLM); returns the weight version."""
        start = getattr(self.engine, "start", None)
        if start is not None:
            await start()
        return self.engine.version

    async def shutdown(self) -> None:
        await self.engine.shutdown()


class RemoteEngine(InferenceEngine):
    """An InferenceEngine whose work happens in an `EngineReplica` actor."""

    def __init__(self, handle: Any, index: int = 0) -> None:
        self.handle = handle
        self.index = index
        self._version = -1

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self.handle.generate.remote(request)

    async def abort(self, request_ids: Optional[Sequence[str]] = None) -> None:
        await self.handle.abort.remote(None if request_ids is None else list(request_ids))

    async def update_weights(self, named_tensors: Iterable[Any], version: int) -> None:
        """Buckets (or ObjectRefs of buckets) go to the actor by reference, fetched there one by one."""
        refs = [item if isinstance(item, ray.ObjectRef) else ray.put(item) for item in named_tensors]
        await self.handle.load_buckets.remote(refs, version)
        self._version = version

    async def load_ipc_bucket(self, payload: dict, version: int) -> dict:
        out = await self.handle.load_ipc_bucket.remote(payload, version)
        self._version = version
        return out

    async def weight_sync_ranks(self) -> int:
        return int(await self.handle.weight_sync_ranks.remote())

    async def join_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str,
                               timeout_s: float, name: str) -> None:
        await self.handle.join_weight_sync.remote(host, port, rank, world_size, backend, timeout_s, name)

    async def receive_weights(self, plan: list, version: int, *, double_buffer: bool = True,
                              verify: bool = False) -> dict:
        out = await self.handle.receive_weights.remote(plan, version, double_buffer, verify)
        self._version = version
        return out

    async def leave_weight_sync(self) -> None:
        await self.handle.leave_weight_sync.remote()

    async def pause(self) -> None:
        await self.handle.pause.remote()

    async def resume(self) -> None:
        await self.handle.resume.remote()

    def stats(self) -> EngineStats:
        return ray.get(self.handle.stats.remote(), timeout=60)

    @property
    def version(self) -> int:
        return self._version

    async def shutdown(self) -> None:
        await self.handle.shutdown.remote()


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


def start_replicas(
    count: int,
    spec: ReplicaSpec,
    *,
    engine_overrides: Optional[Sequence[Mapping[str, Any]]] = None,
    timeout_s: float = 600,
) -> list[RemoteEngine]:
    """Start `count` replica actors and wait until each has loaded its model.

    `engine_overrides[i]`: engine keyword arguments for replica i only (P-DSR: a fast
    replica's larger max_num_seqs).
    """
    tp = int(spec.rollout_cfg.get("tensor_model_parallel_size", 1) or 1)
    if engine_overrides is not None and len(engine_overrides) != count:
        raise ValueError(f"engine_overrides has {len(engine_overrides)} entries for {count} replicas")
    actor_cls = ray.remote(EngineReplica)
    run_tag = uuid.uuid4().hex[:8]  # names show up in `ray list actors` and let operators find a replica
    handles = [
        actor_cls.options(
            max_concurrency=1000, name=f"verl_async_replica{i}_{run_tag}",
            **replica_actor_options(spec.device, tp, colocated=bool(spec.shared_devices)),
        ).remote(spec, i, engine_overrides[i] if engine_overrides is not None else None)
        for i in range(count)
    ]
    ray.get([h.ready.remote() for h in handles], timeout=timeout_s)
    return [RemoteEngine(h, i) for i, h in enumerate(handles)]


class SyncTarget(EngineGroupEndpoint, IpcEndpoint):
    """Replicas that only receive weights: the rollout side of a sync without a Rollouter.

    `CollectiveSync` / `ObjectStoreSync` need pause/resume and the sync fan-out; sync checks and
    benchmarks (scripts/check_sync_gpu.py, tests) wrap this class in a Ray actor.
    """

    def __init__(self, count: int, rollout_cfg: Mapping[str, Any], model_path: str, device: str, *,
                 timeout_s: float = 600, **spec: Any) -> None:
        engines = start_replicas(count, ReplicaSpec(rollout_cfg, model_path, device, **spec), timeout_s=timeout_s)
        EngineGroupEndpoint.__init__(self, engines)
        IpcEndpoint.__init__(self, engines)
        self.pauses = 0
        self.version = -1

    async def pause_for_sync(self) -> None:
        self.pauses += 1

    async def resume_after_sync(self, version: int) -> None:
        self.version = version

    async def load_buckets(self, refs: list, version: int) -> None:
        import asyncio

        await asyncio.gather(*(e.update_weights(list(refs), version) for e in self.sync_engines))

    def state(self) -> tuple[int, int]:
        return self.pauses, self.version

    async def loaded_checksums(self) -> dict[str, dict[str, str]]:
        """Per replica: checksum of every parameter its engine holds now (tests, sync checks)."""
        return {f"replica {i}": await e.handle.loaded_checksums.remote() for i, e in enumerate(self.sync_engines)}

    def kill_replica(self, index: int) -> None:
        ray.kill(self.sync_engines[index].handle)
