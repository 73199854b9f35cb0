"""CUDA IPC weight sync (`async_training.sync_transport=cuda_ipc`): colocated engines map the trainer's buffers.

With `rollout.colocate=true` each engine replica is another process on one of the trainer's
GPUs (replica i pins the node's device i, config/derived.py `colocated_device_ids`). Instead
of device->host copies, the object store and host->device copies, the trainer rank on a
replica's GPU packs each bucket of full parameters (already in the sync dtype, on the device)
into ONE contiguous device buffer, exports it with `torch.multiprocessing.reductions.reduce_tensor`
(a cudaIpcMemHandle of the buffer's allocation plus offsets, a ref-counter slot and an event
the receiver waits on) and sends only that small tuple and the layout (names, dtypes, shapes,
byte offsets) through Ray. The replica maps the buffer, views each tensor in it, loads them
with the engine's own `update_weights` (device-to-device copies into the live parameters),
synchronises, drops every reference to the mapped memory and returns.

Which rank serves which replica (`route_replicas`): the one on the same GPU, matched by GPU
UUID (Ray numbers devices per process, and need not give trainer rank i the node's device i).
Every rank takes part in the FSDP2 gathers (`iter_full_params(every_rank=True)`: each rank
holds the gathered full tensor anyway); a rank with replicas fills the bucket plan
(buckets.py `plan_for` / `fill_bucket`, the collective transports' plan) into its own buffers
and ships them to its replicas only, so N colocated (rank, replica) pairs move the weights
in parallel, each over its own GPU's memory. Double buffering
(`checkpoint_engine.overlap_broadcast_and_consume`): the rank gathers and fills bucket i+1
while its replicas load bucket i; one load per replica at a time.

`CudaIpcSync` only defines the transfer (verl_async/sync/driver.py pauses and resumes).
Each replica gets its own export of a buffer: every `reduce_tensor` call takes one slot of
torch's IPC ref counter, and the receiver's storage releases exactly one when it dies. The
handle carries the exporter's device index; the receiver maps it by GPU UUID to its own
index, and refuses with a clear error when that GPU is not visible to it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Iterator, Mapping, Optional, Sequence

import ray
import torch

from verl_async.sync.buckets import (ALIGN_BYTES, Bucket, TensorMeta, bucket_view, check_exhausted,
                                     compare_checksums, fill_bucket, loaded_checksums, max_bucket_bytes,
                                     metas_from_wire, metas_to_wire, plan_buckets, plan_for, tensor_checksum)
from verl_async.sync.driver import SyncDriver, SyncError
from verl_async.sync.ports import EngineHalf, RolloutHalf, engine_call, innermost

FAMILY = "cuda_ipc"

_DEVICE_ARG = 6  # rebuild_cuda_tensor's `storage_device` (an int: the exporter's device index)


# ---------------------------------------------------------------------------------------- layout (pure)
def layout(pairs: Sequence[tuple[str, torch.Tensor]], align: int = ALIGN_BYTES) -> tuple[list[TensorMeta], int]:
    """Byte offsets of each tensor in one flat buffer (each start a multiple of `align`); returns (metas, nbytes)."""
    if align <= 0 or align % 8:
        raise ValueError(f"cuda_ipc: alignment must be a positive multiple of 8 bytes, got {align}")
    # the collective transports' bucket plan, with the whole list in one bucket (bucketize sized it already)
    plan = plan_buckets(((n, t.dtype, t.shape) for n, t in pairs), bucket_bytes=1 << 62, align=align)
    return (list(plan[0].tensors), plan[0].nbytes) if plan else ([], 0)


def pack(pairs: Sequence[tuple[str, torch.Tensor]], device: Any = None,
         align: int = ALIGN_BYTES) -> tuple[torch.Tensor, list[TensorMeta]]:
    """One flat uint8 buffer (on `device`, default the first tensor's) holding every tensor's bytes at its offset."""
    metas, nbytes = layout(pairs, align)
    if device is None:
        device = pairs[0][1].device if pairs else "cpu"
    buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)  # 1: a storage IPC can export
    for (_, t), meta in zip(pairs, metas):
        if meta.nbytes:
            bucket_view(buffer, meta).copy_(t.detach(), non_blocking=True)
    return buffer, metas


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    return [(m.name, bucket_view(buffer, m)) for m in metas]


# ---------------------------------------------------------------------------------------- IPC handles (CUDA)
def device_uuid(index: int) -> str:
    """A GPU's identity across processes (CUDA_VISIBLE_DEVICES renumbers devices per process)."""
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))


def gpu_of(device: Any, who: str) -> str:
    """The UUID of the CUDA device `device` (a torch.device, or None: this thread's current one)."""
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        raise SyncError(f"cuda_ipc: {who} runs on {device}, not on a CUDA device")
    uuid = device_uuid(torch.cuda.current_device() if device.index is None else device.index)
    if not uuid:
        raise SyncError(f"cuda_ipc: torch reports no UUID for {who}'s GPU, so it cannot be matched with a trainer "
                        "rank's; use async_training.sync_transport=object_store")
    return uuid


def export(buffer: torch.Tensor) -> dict[str, Any]:
    """The IPC handle of a CUDA buffer for ONE receiver (each call takes one slot of torch's IPC ref counter)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if buffer.device.type != "cuda":
        raise SyncError(f"cuda_ipc: the bucket buffer must be on a CUDA device, got {buffer.device}")
    fn, args = reduce_tensor(buffer)
    if fn is not rebuild_cuda_tensor:
        raise SyncError(f"cuda_ipc: torch exported the buffer with {getattr(fn, '__name__', fn)}, not "
                        "rebuild_cuda_tensor (expandable_segments or an unsupported allocator?)")
    return {"args": tuple(args), "uuid": device_uuid(int(args[_DEVICE_ARG]))}


def local_device_index(exported: dict[str, Any]) -> int:
    """This process's index of the GPU the buffer lives on (matched by UUID)."""
    uuid = exported.get("uuid") or ""
    count = torch.cuda.device_count()
    if uuid:
        for i in range(count):
            if device_uuid(i) == uuid:
                return i
        raise SyncError(
            f"cuda_ipc: the trainer's GPU ({uuid}) is not visible to this engine process (it sees {count} "
            "device(s)); cuda_ipc needs each engine replica on a trainer rank's GPU (rollout.colocate=true, "
            "tensor parallel 1); use async_training.sync_transport=object_store otherwise")
    return int(exported["args"][_DEVICE_ARG])


def open_exported(exported: dict[str, Any]) -> torch.Tensor:
    """Map an exported buffer into this process (never the exporting process: CUDA refuses that)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(exported["args"])
    args[_DEVICE_ARG] = local_device_index(exported)
    return rebuild_cuda_tensor(*args)


# ---------------------------------------------------------------------------------------- routes (pure)
ROUTE_HINT = ("rollout.colocate=true pins engine replica i to the node's device i (config/derived.py "
              "colocated_device_ids) and Ray placed the trainer's ranks on other devices: set trainer.n_gpus_per_node "
              "to the node's GPU count (nothing else on the node, no CUDA_VISIBLE_DEVICES subset at start), or use "
              "async_training.sync_transport=object_store")


def _short(uuid: str) -> str:
    """The first 8 hex digits of a GPU UUID (what `nvidia-smi -L` shows after "GPU-")."""
    return uuid.removeprefix("GPU-")[:8]


def route_replicas(rank_gpus: Sequence[str], replica_gpus: Mapping[int, str]) -> dict[int, list[int]]:
    """Which trainer rank serves which engine replica: the rank on the replica's GPU (GPUs named by UUID).

    Returns {rank: [replica, ...]} for every rank (a rank without a replica on its GPU: []). A replica on a GPU
    no rank holds, or a GPU two ranks claim, raises SyncError naming the keys to change."""
    seen: dict[str, int] = {}
    for rank, gpu in enumerate(rank_gpus):
        if gpu in seen:
            raise SyncError(f"cuda_ipc: trainer ranks {seen[gpu]} and {rank} report the same GPU ({_short(gpu)}); "
                            "each rank needs a GPU of its own (trainer.n_gpus_per_node)")
        seen[gpu] = rank
    routes: dict[int, list[int]] = {rank: [] for rank in range(len(rank_gpus))}
    for replica, gpu in sorted(replica_gpus.items()):
        if gpu not in seen:
            ranks = ", ".join(f"rank {r} on {_short(g)}" for r, g in enumerate(rank_gpus))
            raise SyncError(f"cuda_ipc: engine replica {replica} runs on GPU {_short(gpu)}, where no trainer rank "
                            f"runs (GPUs by UUID: {ranks}); {ROUTE_HINT}")
        routes[seen[gpu]].append(int(replica))
    return routes


# ---------------------------------------------------------------------------------------- a trainer rank (sender)
def _collect(ref: Any, index: int, timeout_s: float, into: dict[str, Any]) -> None:
    """Wait for one bucket's load on this rank's replicas and merge what they reported into `into`."""
    try:
        results = ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        raise SyncError(f"cuda_ipc: bucket {index} was not loaded within {timeout_s:.0f}s") from exc
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
        raise SyncError(f"cuda_ipc: loading bucket {index} failed: {exc}") from exc
    for who, got in (results or {}).items():
        mine = into.setdefault(who, {"checksums": {}, "loaded_checksums": {}, "seconds": 0.0})
        mine["checksums"].update(got.get("checksums") or {})
        mine["loaded_checksums"].update(got.get("loaded_checksums") or {})
        mine["seconds"] += float(got.get("seconds", 0.0))


def send_buckets_ipc(plan: Sequence[Bucket], tensors: Iterator[tuple[str, torch.Tensor]], target: Any,
                     replicas: Sequence[int], version: int, *, timeout_s: float, verify: bool = False,
                     double_buffer: bool = True, device: Any = None) -> dict[str, Any]:
    """Consume (name, full tensor) in plan order; with `replicas` (this rank's), fill each bucket into a device
    buffer, export it once per replica and ship it to the rollout side's `load` step (`target.weight_sync`).

    A rank without replicas only drives the gathers behind `tensors`. Returns {"buckets", "bytes", "checksums"
    (verify), "receivers" (per replica, merged over buckets: checksums, loaded_checksums, seconds), "gather_s",
    "wait_s" (blocked on the replicas' loads)}."""
    out: dict[str, Any] = {"buckets": 0, "bytes": 0, "checksums": {}, "receivers": {}, "gather_s": 0.0, "wait_s": 0.0}
    if not replicas:
        for _ in tensors:
            pass
        return out
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    size = max(max_bucket_bytes(plan), 1)  # 1: a storage IPC can export
    slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2 if double_buffer else 1)]
    on_cuda = device.type == "cuda"  # (the flow also runs on host buffers: tests/test_sync_ipc.py)
    in_flight: deque = deque()  # (ref, bucket index): at most one load per replica at a time
    try:
        for i, bucket in enumerate(plan):
            if len(slots) == 1 and in_flight:  # one buffer: its last bucket must be loaded before it is refilled
                t0 = time.perf_counter()
                _collect(*in_flight.popleft(), timeout_s, out["receivers"])
                out["wait_s"] += time.perf_counter() - t0
            buffer = slots[i % len(slots)]
            out["gather_s"] += fill_bucket(buffer, bucket, tensors, out["checksums"] if verify else None)
            if on_cuda:  # the bytes are in place before any replica reads them (the export's event orders it too)
                torch.cuda.current_stream(device).synchronize()
            if in_flight:  # bucket i-1 loaded: its buffer is free for bucket i+1, and each replica loads in order
                t0 = time.perf_counter()
                _collect(*in_flight.popleft(), timeout_s, out["receivers"])
                out["wait_s"] += time.perf_counter() - t0
            payload = {"layout": metas_to_wire(bucket.tensors), "nbytes": int(bucket.nbytes),
                       "handles": {int(r): export(buffer) for r in replicas}, "verify": bool(verify)}
            in_flight.append((target.weight_sync.remote(FAMILY, "load", payload, version=int(version)), i))
            del payload
            out["buckets"] += 1
            out["bytes"] += sum(m.nbytes for m in bucket.tensors)
        while in_flight:
            t0 = time.perf_counter()
            _collect(*in_flight.popleft(), timeout_s, out["receivers"])
            out["wait_s"] += time.perf_counter() - t0
        check_exhausted(tensors)
    finally:
        del slots  # every replica returned (or the sync failed): nothing maps the buffers any more
        if on_cuda:
            torch.cuda.ipc_collect()  # buffers a receiver still held at free time (limbo) go back now
    return out


class TrainerSide:
    """A trainer rank's half: its GPU, and the gathers plus (where it serves replicas) the buckets it ships.

    The rank provides `rank`, `settings.device`, `device.torch_device`, `sync_dtype(dtype)`, `full_param_shapes()`
    and `iter_full_params(dtype, to_cpu=False, every_rank=...)` (collective: every rank iterates)."""

    def __init__(self, rank: Any) -> None:
        self.rank = rank

    def _check_device(self) -> None:
        if self.rank.settings.device != "cuda":
            raise SyncError(f"cuda_ipc needs trainer.device=cuda, got {self.rank.settings.device}")

    def gpu(self) -> str:
        """The UUID of this rank's GPU (the driver routes each replica to the rank on its GPU)."""
        self._check_device()
        return gpu_of(self._device(), f"trainer rank {self.rank.rank}")

    def _device(self) -> Any:
        return getattr(getattr(self.rank, "device", None), "torch_device", None)

    def send(self, target: Any, routes: Mapping[int, Sequence[int]], version: int, bucket_bytes: int,
             timeout_s: float, verify: bool = False, double_buffer: bool = True,
             dtype: Optional[str] = None) -> dict:
        """Every rank gathers; a rank with replicas in `routes` ({rank: [replica, ...]}) ships each bucket's IPC
        handles to them through `target` and frees its buffers once they have loaded every bucket."""
        self._check_device()
        mine = [int(r) for r in routes.get(int(self.rank.rank), ())]
        plan = plan_for(self.rank, bucket_bytes, dtype, transport="cuda_ipc")
        tensors = iter(self.rank.iter_full_params(self.rank.sync_dtype(dtype), to_cpu=False, every_rank=bool(mine)))
        t0 = time.perf_counter()
        try:
            out = send_buckets_ipc(plan, tensors, target, mine, version, timeout_s=timeout_s, verify=verify,
                                   double_buffer=double_buffer, device=self._device())
        except BaseException:
            for _ in tensors:  # finish the gathers so the other trainer ranks are not left blocked in them
                pass
            raise
        out["seconds"] = time.perf_counter() - t0
        out["replicas"] = mine
        return out


# ---------------------------------------------------------------------------------------- replica (receiver)
def engine_device(engine: Any) -> Any:
    """The device an engine's weights live on (its model's first parameter); None when it has no model."""
    model = getattr(innermost(engine), "model", None)
    if model is None:
        return None
    first = next(iter(model.parameters()), None)
    return None if first is None else first.device


class EngineSide(EngineHalf):
    """Maps one exported bucket, loads its tensors into the engine (device to device), releases the mapping."""

    async def gpu(self) -> str:
        return gpu_of(engine_device(self.engine), "this engine replica")

    async def load(self, payload: dict[str, Any], *, version: int) -> dict[str, Any]:
        return await load_ipc_bucket(self.engine, payload, version)


async def load_ipc_bucket(engine: Any, payload: dict[str, Any], version: int) -> dict[str, Any]:
    """Map one exported bucket, load its tensors into `engine` (device to device), release the mapping."""
    t0 = time.perf_counter()
    metas = metas_from_wire(payload["layout"])
    handles = payload["handles"]
    if len(handles) != 1:
        raise SyncError(f"cuda_ipc: a replica takes one export of a bucket, got {len(handles)}")
    buffer = open_exported(handles[0])
    out: dict[str, Any] = {}
    try:
        pairs = unpack(buffer, metas)
        if payload.get("verify"):
            out["checksums"] = {n: tensor_checksum(t) for n, t in pairs}
        await engine.update_weights([pairs], version)
        torch.cuda.synchronize(buffer.device)  # every copy out of the mapped memory has finished
        if payload.get("verify"):
            out["loaded_checksums"] = loaded_checksums(engine, [Bucket(tuple(metas), int(payload["nbytes"]))])
    finally:
        pairs = None  # noqa: F841 - the views keep the mapping (and torch's ref-counter slot) alive
        del buffer
    out["seconds"] = time.perf_counter() - t0
    return out


def replica_key(engine: Any, position: int) -> int:
    """A replica's name in routes: its index in the run (a `RemoteEngine`'s), else its position."""
    index = getattr(engine, "index", None)
    return int(index) if isinstance(index, int) else int(position)


class RolloutSide(RolloutHalf):
    """Tells each replica's GPU, and hands each replica named in a bucket's payload its own export."""

    family, engine_half = FAMILY, EngineSide

    def by_key(self) -> dict[int, Any]:
        return {replica_key(e, i): e for i, e in enumerate(self.engines())}

    async def gpus(self) -> dict[int, str]:
        engines = self.by_key()
        return dict(zip(engines, await self.each("gpu", engines=list(engines.values()))))

    async def load(self, payload: dict[str, Any], *, version: int) -> dict[str, dict]:
        engines = self.by_key()
        handles = {int(k): h for k, h in payload["handles"].items()}
        gone = sorted(set(handles) - set(engines))
        if gone:
            raise SyncError(f"cuda_ipc: engine replica(s) {gone} are not in this sync (out of rotation since the "
                            f"routes were made); in the sync: {sorted(engines)}")
        results = await asyncio.gather(*(engine_call(engines[k], FAMILY, EngineSide, "load",
                                                     {**payload, "handles": [h]}, version=version)
                                         for k, h in handles.items()))
        return {f"replica {k}": r or {} for k, r in zip(handles, results)}


# ---------------------------------------------------------------------------------------- driver
def ipc_problems(senders: Mapping[int, dict], routes: Mapping[int, Sequence[int]]) -> list[str]:
    """Tensors a replica received or loaded with other bits than its serving rank sent (verify=True)."""
    problems: list[str] = []
    for rank, replicas in routes.items():
        sent = senders[rank].get("checksums") or {}
        got = senders[rank].get("receivers") or {}
        for replica in replicas:
            who = f"replica {replica}"
            mine = got.get(who, {})
            problems += compare_checksums(sent, mine.get("checksums") or {}, who)
            loaded = mine.get("loaded_checksums") or {}
            problems += [p + " (after load)" for p in compare_checksums(
                {k: v for k, v in sent.items() if k in loaded}, loaded, who)]
    return problems


def ipc_metrics(senders: Mapping[int, dict], routes: Mapping[int, Sequence[int]], seconds: float) -> dict[str, float]:
    """The sync's numbers: one model copy's bytes and buckets, GB/s over the transfer, and its phases from the
    slowest serving rank (its gathers, its whole send) and the slowest replica (its maps and loads, summed)."""
    serving = [r for r in routes if routes[r]]
    if not serving:
        return {"sync/buckets": 0.0, "sync/bytes": 0.0, "sync/replicas": 0.0}
    slowest = max(serving, key=lambda r: float(senders[r].get("seconds", 0.0)))
    nbytes = float(max(senders[r]["bytes"] for r in serving))
    loads = [float(v.get("seconds", 0.0)) for r in serving for v in (senders[r].get("receivers") or {}).values()]
    out = {
        "sync/buckets": float(max(senders[r]["buckets"] for r in serving)),
        "sync/bytes": nbytes,
        "sync/replicas": float(sum(len(routes[r]) for r in serving)),
        "sync/gbps": nbytes / max(seconds, 1e-9) / 1e9,
        "timing_s/sync_gather": float(senders[slowest].get("gather_s", 0.0)),
        "timing_s/sync_send": float(senders[slowest].get("seconds", 0.0)),
        "timing_s/sync_wait_load": float(senders[slowest].get("wait_s", 0.0)),
    }
    if loads:
        out["timing_s/sync_receive_load"] = max(loads)
    return out


class CudaIpcSync(SyncDriver):
    """The transfer is CUDA IPC: each trainer rank ships handles of its device buffers to the replicas on its GPU.

    The ranks' GPUs are asked once; the replicas' on every sync (a healed replica is a new process), and
    `route_replicas` pairs them. `double_buffer`: `checkpoint_engine.overlap_broadcast_and_consume`."""

    family = FAMILY

    def __init__(self, worker_group: Any, rollouter: Any, *, bucket_bytes: int, timeout_s: float = 600.0,
                 verify: bool = False, double_buffer: bool = True, **_: Any) -> None:
        super().__init__(worker_group, rollouter, bucket_bytes=bucket_bytes, timeout_s=timeout_s, verify=verify)
        self.double_buffer = bool(double_buffer)
        self._rank_gpus: Optional[list[str]] = None

    def routes(self) -> dict[int, list[int]]:
        if self._rank_gpus is None:
            refs = self.worker_group.weight_sync_refs(FAMILY, "gpu")
            got = self.wait({f"trainer rank {r}": ref for r, ref in enumerate(refs)},
                            "asking the trainer ranks for their GPUs")
            self._rank_gpus = [got[f"trainer rank {r}"] for r in range(len(refs))]
        replicas = self.rollout("gpus", "asking the engine replicas for their GPUs")
        return route_replicas(self._rank_gpus, {int(k): v for k, v in replicas.items()})

    def transfer(self, version: int) -> dict[str, float]:
        routes = self.routes()
        t0 = time.perf_counter()
        refs = self.worker_group.weight_sync_refs(FAMILY, "send", self.rollouter, routes, int(version),
                                                  self.bucket_bytes, self.timeout_s, self.verify, self.double_buffer)
        results = self.wait({f"trainer rank {r}": ref for r, ref in enumerate(refs)},
                            f"sending the weights (version {version})")
        seconds = time.perf_counter() - t0
        senders = {r: results[f"trainer rank {r}"] for r in range(len(refs))}
        if self.verify:
            problems = ipc_problems(senders, routes)
            if problems:
                raise SyncError(f"parameter sync: {len(problems)} tensor(s) not bit-exact: {problems[:5]}")
        first = next((r for r in sorted(routes) if routes[r]), 0)
        receivers: dict[str, Any] = {}
        for sender in senders.values():
            receivers.update(sender.get("receivers") or {})
        metrics = {"timing_s/param_sync": seconds, **ipc_metrics(senders, routes, seconds)}
        self.last = {"routes": routes, "seconds": seconds, "senders": senders, "receivers": receivers,
                     "checksums": senders[first].get("checksums") or {}, "metrics": metrics}
        return metrics
