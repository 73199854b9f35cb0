"""CUDA IPC weight sync (`async_training.sync_transport=cuda_ipc`): a colocated engine maps the trainer's buffers.

With `rollout.colocate=true` the engine replica is another process on the trainer's GPU.
Instead of device->host copies, the object store and host->device copies, trainer rank 0
packs each bucket of full parameters (already in the sync dtype, on the device) into ONE
contiguous device buffer, exports it with `torch.multiprocessing.reductions.reduce_tensor`
(a cudaIpcMemHandle of the buffer's allocation plus offsets, a ref-counter slot and an
event the receiver waits on) and sends only that small tuple and the layout (names,
dtypes, shapes, byte offsets) through Ray. The replica maps the buffer, views each tensor
in it, loads them with the engine's own `update_weights` (device-to-device copies into the
live parameters), synchronises, drops every reference to the mapped memory and returns;
rank 0 frees the buffer only after every replica returned.

The flow on rank 0 (`TrainerSide.send`) is one call: every rank iterates
`iter_full_params(dtype, to_cpu=False)` (the gathers are collective), rank 0 fills, exports
and ships bucket after bucket to the rollout side (its `load` step, fanned out to every
replica) and waits for it. `CudaIpcSync` only defines the transfer (verl_async/sync/driver.py
pauses and resumes).

Each replica gets its own export of a buffer: every `reduce_tensor` call takes one slot of
torch's IPC ref counter, and the receiver's storage releases exactly one when it dies.
The handle carries the trainer's device index; the receiver maps it by GPU UUID to its own
index (Ray gives each actor its own CUDA_VISIBLE_DEVICES numbering), and refuses with a
clear error when the trainer's GPU is not visible to it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable, Optional, Sequence

import ray
import torch

from verl_async.sync.buckets import (ALIGN_BYTES, Bucket, TensorMeta, bucket_view, bucketize, loaded_checksums,
                                     metas_from_wire, metas_to_wire, plan_buckets, tensor_checksum)
from verl_async.sync.driver import SyncDriver, SyncError
from verl_async.sync.ports import EngineHalf, RolloutHalf, engine_call

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
            "device(s)); cuda_ipc needs the engine on the trainer rank 0's GPU (rollout.colocate=true, one "
            "replica); use async_training.sync_transport=object_store otherwise")
    return int(exported["args"][_DEVICE_ARG])


def open_exported(exported: dict[str, Any]) -> torch.Tensor:
    """Map an exported buffer into this process (never the exporting process: CUDA refuses that)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(exported["args"])
    args[_DEVICE_ARG] = local_device_index(exported)
    return rebuild_cuda_tensor(*args)


# ---------------------------------------------------------------------------------------- rank 0 (sender)
def send_buckets_ipc(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, target: Any, receivers: int,
                     version: int, *, timeout_s: float, verify: bool = False, is_sender: bool = True,
                     align: int = ALIGN_BYTES) -> dict[str, Any]:
    """Rank 0: pack, export and ship each bucket to the rollout side's `load` step and wait for it; others iterate.

    `target` is the rollout actor (its `weight_sync("cuda_ipc", "load", payload, version=...)`).
    Returns {"buckets", "bytes", "checksums" (verify), "receivers" (what each replica reported, per bucket merged)}.
    """
    out: dict[str, Any] = {"buckets": 0, "bytes": 0, "checksums": {}, "receivers": {}}
    for pairs in bucketize(named, bucket_bytes):
        if not is_sender:
            continue
        buffer, metas = pack(pairs, align=align)
        if verify:
            out["checksums"].update({n: tensor_checksum(t) for n, t in pairs})
        del pairs  # the gathered full tensors: only the packed copy is needed now
        torch.cuda.current_stream(buffer.device).synchronize()  # belt and braces: the export's event orders it too
        payload = {"layout": metas_to_wire(metas), "nbytes": int(buffer.numel()),
                   "handles": [export(buffer) for _ in range(int(receivers))], "verify": bool(verify)}
        try:
            results = ray.get(target.weight_sync.remote(FAMILY, "load", payload, version=int(version)), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise SyncError(f"cuda_ipc: bucket {out['buckets']} was not loaded within {timeout_s:.0f}s") from exc
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
            raise SyncError(f"cuda_ipc: loading bucket {out['buckets']} failed: {exc}") from exc
        finally:
            del payload
        for who, got in (results or {}).items():
            mine = out["receivers"].setdefault(who, {"checksums": {}, "loaded_checksums": {}})
            mine["checksums"].update(got.get("checksums") or {})
            mine["loaded_checksums"].update(got.get("loaded_checksums") or {})
        out["buckets"] += 1
        out["bytes"] += sum(m.nbytes for m in metas)
        del buffer  # every replica returned: it no longer references the memory
    if is_sender and torch.cuda.is_available():
        torch.cuda.ipc_collect()  # buffers a receiver still held at free time (limbo) go back now
    return out


# ---------------------------------------------------------------------------------------- trainer rank
class TrainerSide:
    def __init__(self, rank: Any) -> None:
        self.rank = rank

    def send(self, target: Any, receivers: int, version: int, bucket_bytes: int, timeout_s: float,
             verify: bool = False, dtype: Optional[str] = None) -> dict:
        """Every rank gathers; rank 0 packs each bucket on the device and ships its IPC handles to `target`,
        freeing the buffer once every replica has loaded it."""
        if self.rank.settings.device != "cuda":
            raise SyncError(f"cuda_ipc needs trainer.device=cuda, got {self.rank.settings.device}")
        named = self.rank.iter_full_params(self.rank.sync_dtype(dtype), to_cpu=False)
        return send_buckets_ipc(named, bucket_bytes, target, receivers, version, timeout_s=timeout_s, verify=verify,
                                is_sender=self.rank.rank == 0)


# ---------------------------------------------------------------------------------------- replica (receiver)
class EngineSide(EngineHalf):
    """Maps one exported bucket, loads its tensors into the engine (device to device), releases the mapping."""

    async def load(self, payload: dict[str, Any], *, version: int) -> dict[str, Any]:
        return await load_ipc_bucket(self.engine, payload, version)


async def load_ipc_bucket(engine: Any, payload: dict[str, Any], version: int) -> dict[str, Any]:
    """Map one exported bucket, load its tensors into `engine` (device to device), release the mapping."""
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
    return out


class RolloutSide(RolloutHalf):
    """Hands replica i its own export of each bucket."""

    family, engine_half = FAMILY, EngineSide

    async def receivers(self) -> int:
        return len(self.engines())

    async def load(self, payload: dict[str, Any], *, version: int) -> dict[str, dict]:
        engines = self.engines()
        handles = payload["handles"]
        if len(handles) != len(engines):
            raise SyncError(f"cuda_ipc: {len(handles)} export(s) of the bucket for {len(engines)} replica(s)")
        results = await asyncio.gather(*(engine_call(e, FAMILY, EngineSide, "load", {**payload, "handles": [h]},
                                                     version=version)
                                         for e, h in zip(engines, handles)))
        return {f"replica {i}": r or {} for i, r in enumerate(results)}


# ---------------------------------------------------------------------------------------- driver
class CudaIpcSync(SyncDriver):
    """The transfer is CUDA IPC: rank 0 ships handles of its device buffers to the colocated replica."""

    family = FAMILY

    def __init__(self, worker_group: Any, rollouter: Any, *, bucket_bytes: int, timeout_s: float = 600.0,
                 verify: bool = False, **_: Any) -> None:
        super().__init__(worker_group, rollouter, bucket_bytes=bucket_bytes, timeout_s=timeout_s, verify=verify)
        self._receivers: Optional[int] = None

    def transfer(self, version: int) -> dict[str, float]:
        if self._receivers is None:
            self._receivers = int(self.rollout("receivers", "counting the replicas"))
        refs = self.worker_group.weight_sync_refs(FAMILY, "send", self.rollouter, self._receivers, int(version),
                                                  self.bucket_bytes, self.timeout_s, self.verify)
        results = self.wait({f"trainer rank {r}": ref for r, ref in enumerate(refs)},
                            f"sending the weights (version {version})")
        self.last = results["trainer rank 0"]
        return {"sync/buckets": float(self.last["buckets"]), "sync/bytes": float(self.last["bytes"])}
