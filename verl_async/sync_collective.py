"""Collective weight sync: trainer rank 0 broadcasts bucketed weights to every engine rank.

Transports `nccl` (CUDA), `hccl` (NPU) and `gloo` (any device through host memory; the
test/debug transport) all run this module. One sync group spans trainer rank 0 (rank 0
of the group, the sender) and every engine rank (one per native replica, one per
tensor-parallel worker of a vLLM replica). It is built across Ray actors WITHOUT a global
`init_process_group`: rank 0 hosts a `TCPStore` on a free port, every member builds the
backend directly on a `PrefixStore` of it (`ProcessGroupNCCL` / `ProcessGroupGloo` /
torch_npu's `ProcessGroupHCCL`), like vLLM's `stateless_init_torch_distributed_process_group`.
So it lives beside the trainer's FSDP group and vLLM's own groups without touching them.

A sync moves a *plan* (verl_async/bucket_plan.py): buckets of (HF name, dtype, full shape,
byte offset), computed from parameter metadata without any gather (FSDP2 DTensors know
their global shape) and identical on all sides. Per bucket, rank 0 copies the gathered full tensors into a flat
byte buffer and broadcasts it; receivers view their buffer as the tensors and hand them to
the engine. Double buffering: two buffers per side, so rank 0 gathers bucket i+1 while
bucket i is on the wire, and a receiver posts the receive of bucket i+1 before loading
bucket i (CUDA: the broadcast runs on the communicator's stream, ordered against the
copies by the process group's stream events; gloo: `async_op` work in gloo's threads).

Bit-exactness is checkable: with `verify=True` both sides compute a checksum per tensor
(an order-sensitive integer sum over the raw bits) and the driver compares them.

Failures never hang: every group op has the group timeout, every wait of the driver has
`timeout_s`, and a dead member surfaces as `SyncError` naming it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from verl_async.bucket_plan import (Bucket, bucket_view, compare_checksums, dtype_name, max_bucket_bytes,
                                     plan_from_wire, tensor_checksum)
from verl_async.sync import SyncError
from verl_async.utils.waiting import WaitTimeout, finished_in_turn

logger = logging.getLogger("verl_async.sync")

_GROUP_PREFIX = "verl_async/weight_sync"
BACKENDS = ("nccl", "hccl", "gloo")


# ---------------------------------------------------------------------------------------- the group
def host_address(local_only: bool) -> str:
    """Where group rank 0 listens: loopback when everything is on one node, else this node's address."""
    if local_only:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


def buffer_device(backend: str) -> torch.device:
    """gloo moves host memory; nccl / hccl the current accelerator's."""
    from verl_async.utils import device as device_layer

    if backend == "gloo":
        return torch.device("cpu")
    kind = {"nccl": "cuda", "hccl": "npu"}[backend]
    mod = device_layer.accelerator_module(kind)
    return torch.device(kind, mod.current_device())


class WeightSyncGroup:
    """One member of the sync group: a backend object built on a TCPStore, no global state."""

    def __init__(self, backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                 *, store: Any = None, name: str = "0") -> None:
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"weight sync: unknown backend {backend!r}; available: {BACKENDS}")
        if not 0 <= rank < world_size:
            raise ValueError(f"weight sync: rank {rank} outside a group of {world_size}")
        self.backend_name = backend
        self.rank, self.world_size = rank, world_size
        self.timeout = timedelta(seconds=float(timeout_s))
        if store is None:
            store = dist.TCPStore(host, int(port), None, is_master=False, wait_for_workers=False, timeout=self.timeout)
        self._store = store  # keep the server (rank 0) alive as long as the group
        prefix = dist.PrefixStore(f"{_GROUP_PREFIX}/{name}", store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefix, rank, world_size, self.timeout)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(prefix, rank, world_size, options)
        else:
            from verl_async.utils import device as device_layer

            device_layer.accelerator_module("npu")  # imports torch_npu, which adds ProcessGroupHCCL
            self.pg = dist.ProcessGroupHCCL(prefix, rank, world_size, self.timeout)  # type: ignore[attr-defined]
        self.device = buffer_device(backend)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Start a broadcast from group rank `src`; returns the work handle (`.wait()`)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.timeout
        return self.pg.broadcast([tensor], opts)

    def handshake(self) -> None:
        """One small broadcast: every member is connected (and NCCL/HCCL communicators exist) before timing starts."""
        t = torch.full((1,), 1 if self.rank == 0 else 0, dtype=torch.int32, device=self.device)
        self.broadcast(t).wait()
        if int(t.item()) != 1:
            raise SyncError(f"weight sync group: handshake broadcast gave {int(t.item())} on rank {self.rank}")

    def close(self) -> None:
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the process may be going away
                pass
        self._store = None


def master_store(host: str, timeout_s: float) -> tuple[Any, int]:
    """Rank 0's TCPStore server on a free port (bound by the store itself: no port race)."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=float(timeout_s)))
    return store, int(store.port)


# ---------------------------------------------------------------------------------------- sender
def send_buckets(group: Optional[WeightSyncGroup], plan: Sequence[Bucket], tensors: Iterator[tuple[str, torch.Tensor]],
                 *, double_buffer: bool = True, verify: bool = False) -> dict[str, Any]:
    """Trainer side: consume (name, full tensor) in plan order; rank 0 (group given) broadcasts each bucket.

    Other trainer ranks pass group=None: they only drive the collective gathers behind `tensors`.
    """
    if group is None:
        for _ in tensors:
            pass
        return {"bytes": 0, "buckets": 0, "checksums": {}}
    device = group.device
    size = max_bucket_bytes(plan)
    buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2 if double_buffer else 1)]
    pending: list[Any] = [None] * len(buffers)
    checksums: dict[str, str] = {}
    sent = 0
    t_gather = 0.0
    for i, bucket in enumerate(plan):
        slot = i % len(buffers)
        if pending[slot] is not None:  # the buffer's last broadcast must be done before we overwrite it
            pending[slot].wait()
            pending[slot] = None
        buf = buffers[slot]
        for meta in bucket.tensors:
            t0 = time.perf_counter()
            try:
                name, tensor = next(tensors)
            except StopIteration:
                raise SyncError(f"weight sync: the model ran out of tensors before {meta.name!r}") from None
            t_gather += time.perf_counter() - t0
            if name != meta.name or tuple(tensor.shape) != meta.shape:
                raise SyncError(f"weight sync: plan expects {meta.name!r} {meta.shape}, the model gave {name!r} "
                                f"{tuple(tensor.shape)}")
            view = bucket_view(buf, meta)
            view.copy_(tensor, non_blocking=True)
            if verify:
                checksums[name] = tensor_checksum(view)
        pending[slot] = group.broadcast(buf[: bucket.nbytes])
        sent += bucket.nbytes
    for work in pending:
        if work is not None:
            work.wait()
    leftover = next(tensors, None)
    if leftover is not None:
        raise SyncError(f"weight sync: the model has tensor {leftover[0]!r} that the plan does not list")
    _synchronize(device)
    return {"bytes": sent, "buckets": len(plan), "checksums": checksums, "gather_s": t_gather}


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        from verl_async.utils import device as device_layer

        device_layer.accelerator_module(device.type).synchronize(device)


# ---------------------------------------------------------------------------------------- receiver
def receive_buckets(group: WeightSyncGroup, plan: Sequence[Bucket], *, double_buffer: bool = True,
                    verify: bool = False, checksums: Optional[dict[str, str]] = None
                    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Engine side: yields each bucket as (name, view into the receive buffer).

    The views are valid until the generator is resumed (the consumer must copy them into
    the model before asking for the next bucket). With double buffering the receive of
    bucket i+1 is already posted while the consumer loads bucket i.
    """
    if not plan:
        return
    buffers = [torch.empty(max_bucket_bytes(plan), dtype=torch.uint8, device=group.device)
               for _ in range(2 if double_buffer else 1)]
    works: dict[int, Any] = {0: group.broadcast(buffers[0][: plan[0].nbytes])}
    for i, bucket in enumerate(plan):
        if double_buffer and i + 1 < len(plan):
            nxt = buffers[(i + 1) % 2]
            works[i + 1] = group.broadcast(nxt[: plan[i + 1].nbytes])
        works.pop(i).wait()
        buf = buffers[i % len(buffers)]
        views = [(meta.name, bucket_view(buf, meta)) for meta in bucket.tensors]
        if verify and checksums is not None:
            for name, view in views:
                checksums[name] = tensor_checksum(view)
        yield views
        if not double_buffer and i + 1 < len(plan):
            works[i + 1] = group.broadcast(buffers[0][: plan[i + 1].nbytes])
    _synchronize(group.device)


class LocalEngineEndpoint:
    """Sync-group member for an in-process engine whose `update_weights` takes (name, tensor) buckets.

    The receive generator is handed to `engine.update_weights`, so the blocking receives run
    where the engine consumes weights (the native engine: its worker thread) and the event
    loop stays free.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.group: Optional[WeightSyncGroup] = None

    async def weight_sync_ranks(self) -> int:
        return 1

    async def join_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str,
                               timeout_s: float, name: str = "0") -> None:
        def join() -> WeightSyncGroup:
            group = WeightSyncGroup(backend, host, port, rank, world_size, timeout_s, name=name)
            group.handshake()
            return group

        await self.leave_weight_sync()
        self.group = await asyncio.to_thread(join)

    async def receive_weights(self, plan_wire: Sequence, version: int, *, double_buffer: bool = True,
                              verify: bool = False) -> dict[str, Any]:
        if self.group is None:
            raise SyncError("weight sync: receive_weights before join_weight_sync")
        plan = plan_from_wire(plan_wire)
        received: dict[str, str] = {}
        t0 = time.perf_counter()
        stream = receive_buckets(self.group, plan, double_buffer=double_buffer, verify=verify, checksums=received)
        await self.engine.update_weights(stream, version)
        out: dict[str, Any] = {"checksums": received, "seconds": time.perf_counter() - t0}
        if verify:
            out["loaded_checksums"] = loaded_checksums(self.engine, plan)
        return out

    async def leave_weight_sync(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def loaded_checksums(engine: Any, plan: Sequence[Bucket]) -> dict[str, str]:
    """Checksums of the engine's own parameters named in the plan (engines that expose `.model`, same dtype)."""
    model = getattr(engine, "model", None)
    if model is None:
        return {}
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for bucket in plan:
        for meta in bucket.tensors:
            p = params.get(meta.name)
            if p is not None and dtype_name(p.dtype) == meta.dtype:
                out[meta.name] = tensor_checksum(p.data)
    return out


_endpoints: "weakref.WeakKeyDictionary[Any, LocalEngineEndpoint]" = weakref.WeakKeyDictionary()


def engine_endpoint(engine: Any) -> Any:
    """The engine itself when it joins sync groups on its own (replica proxies, vLLM), else a local adapter."""
    if hasattr(engine, "join_weight_sync"):
        return engine
    if engine not in _endpoints:
        _endpoints[engine] = LocalEngineEndpoint(engine)
    return _endpoints[engine]


# ---------------------------------------------------------------------------------------- trainer rank
class TrainerEndpoint:
    """What a trainer rank holds: the store and group on rank 0, nothing on the others."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.store: Any = None
        self.group: Optional[WeightSyncGroup] = None
        self.name = "0"

    def address(self, local_only: bool, timeout_s: float) -> tuple[str, int]:
        """Rank 0 starts a fresh TCPStore server; returns where the group meets."""
        self.close()
        host = host_address(local_only)
        self.store, port = master_store(host, timeout_s)
        return host, port

    def join(self, world_size: int, backend: str, timeout_s: float, name: str) -> None:
        if self.rank != 0:
            return
        if self.store is None:
            raise SyncError("weight sync: rank 0 joins before address() started its store")
        self.group = WeightSyncGroup(backend, "", 0, 0, world_size, timeout_s, store=self.store, name=name)
        self.group.handshake()

    def send(self, plan_wire: Sequence, tensors: Iterator[tuple[str, torch.Tensor]], *, double_buffer: bool,
             verify: bool) -> dict[str, Any]:
        if self.rank == 0 and self.group is None:
            raise SyncError("weight sync: send before the group was joined")
        t0 = time.perf_counter()
        try:
            out = send_buckets(self.group if self.rank == 0 else None, plan_from_wire(plan_wire), tensors,
                               double_buffer=double_buffer, verify=verify)
        except BaseException:
            for _ in tensors:  # finish the gathers so the other trainer ranks are not left blocked in them
                pass
            raise
        out["seconds"] = time.perf_counter() - t0
        return out

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.store = None


# ---------------------------------------------------------------------------------------- driver
class CollectiveSync:
    """ParameterSynchronizer over a collective group (`nccl` on CUDA, `hccl` on NPU).

    The group is formed on the first push (timed apart as `timing_s/sync_group_init`) and
    reused. `bucket_bytes` is the bucket size (`async_training.checkpoint_engine.
    device_buffer_size_M`, default `sync_bucket_size_mb`), `double_buffer` overlaps gather
    and broadcast (`checkpoint_engine.overlap_broadcast_and_consume`), `verify` checks every
    tensor's checksum on every engine rank (costs a pass over the weights on both sides).
    """

    backend: Optional[str] = None  # None: from the trainer's device (nccl / hccl)

    def __init__(self, worker_group: Any, rollouter: Any, *, bucket_bytes: int, timeout_s: float = 600.0,
                 double_buffer: bool = True, verify: bool = False, backend: Optional[str] = None) -> None:
        self.worker_group = worker_group
        self.rollouter = rollouter
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = float(timeout_s)
        self.double_buffer = bool(double_buffer)
        self.verify = bool(verify)
        self.backend = backend or self.backend or self._backend_for(worker_group)
        self._plan: Optional[list] = None
        self._world = 0
        self._generation = 0
        self._broken: Optional[str] = None
        self.last: dict[str, Any] = {}

    @staticmethod
    def _backend_for(worker_group: Any) -> str:
        from verl_async.utils import device as device_layer

        kind = str(worker_group.settings.device)
        if kind == "cpu":
            raise SyncError("async_training.sync_transport: nccl/hccl need trainer.device=cuda/npu; "
                            "use gloo (collective over host memory) or object_store on CPU")
        return device_layer.dist_backend(kind)

    # -------------------------------------------------------------- waiting
    def _wait(self, refs: dict[str, Any], what: str) -> dict[str, Any]:
        """Wait for named refs; the first failure or the deadline raises SyncError naming who and what."""
        import ray

        out: dict[str, Any] = {}
        try:
            for name, ref, left in finished_in_turn(refs, self.timeout_s):
                try:
                    out[name] = ray.get(ref, timeout=left)
                except Exception as exc:  # noqa: BLE001 - re-raised as SyncError naming the member
                    self._broken = f"{name} failed in {what}"
                    raise SyncError(f"parameter sync: {name} failed in {what}: {type(exc).__name__}: {exc}") from exc
        except WaitTimeout as late:
            self._broken = f"{what} timed out on {late.pending}"
            raise SyncError(f"parameter sync: {what} did not finish on {late.pending} within {self.timeout_s:.0f}s "
                            f"(a sync-group member is dead or stuck)") from None
        return out

    # -------------------------------------------------------------- group
    def _ensure_group(self) -> float:
        if self._broken:
            raise SyncError(f"parameter sync: the sync group is unusable after an earlier failure ({self._broken})")
        if self._plan is not None:
            return 0.0
        t0 = time.perf_counter()
        wg = self.worker_group
        self._plan = wg.weight_sync_plan(self.bucket_bytes)
        ranks = self._wait({"rollouter": self.rollouter.weight_sync_ranks.remote()}, "counting engine ranks")["rollouter"]
        self._world = 1 + int(sum(ranks))
        local_only = bool(getattr(wg.settings, "nnodes", 1) == 1) and _single_node()
        host, port = wg.weight_sync_address(local_only, self.timeout_s)
        self._generation += 1
        name = f"{self._generation}-{port}"
        refs = {f"trainer rank {r}": ref for r, ref in
                enumerate(wg.join_weight_sync_async(self._world, self.backend, self.timeout_s, name))}
        refs["rollouter"] = self.rollouter.join_weight_sync.remote(host, port, self._world, self.backend,
                                                                   self.timeout_s, name)
        self._wait(refs, f"forming the {self.backend} sync group of {self._world} ranks")
        return time.perf_counter() - t0

    def replan(self, bucket_bytes: int) -> None:
        """New bucket size for the next pushes, keeping the formed group (re-forming one costs a rendezvous)."""
        self.bucket_bytes = int(bucket_bytes)
        if self._plan is not None:
            self._plan = self.worker_group.weight_sync_plan(self.bucket_bytes)

    # -------------------------------------------------------------- one sync
    def transfer(self, version: int) -> dict[str, Any]:
        """Move all buckets to every engine rank (generation must be paused); returns sender/receiver results."""
        init_s = self._ensure_group()
        t0 = time.perf_counter()
        refs = {f"trainer rank {r}": ref for r, ref in
                enumerate(self.worker_group.send_weights_async(self._plan, self.double_buffer, self.verify))}
        refs["rollouter"] = self.rollouter.receive_weights.remote(self._plan, version, self.double_buffer, self.verify)
        out = self._wait(refs, f"broadcasting the weights (version {version})")
        seconds = time.perf_counter() - t0
        sender = out["trainer rank 0"]
        receivers = out["rollouter"]
        if self.verify:
            problems = []
            for who, got in receivers.items():
                problems += compare_checksums(sender["checksums"], got.get("checksums", {}), who)
                loaded = got.get("loaded_checksums") or {}
                problems += [p + " (after load)" for p in compare_checksums(
                    {k: v for k, v in sender["checksums"].items() if k in loaded}, loaded, who)]
            if problems:
                raise SyncError(f"parameter sync: {len(problems)} tensor(s) not bit-exact: {problems[:5]}")
        self.last = {"init_s": init_s, "seconds": seconds, "sender": sender, "receivers": receivers}
        return self.last

    def push(self, version: int, while_paused: Optional[Callable[[], dict]] = None) -> dict[str, float]:
        """Pause -> broadcast -> (while_paused) -> resume; the ParameterSynchronizer interface."""
        t0 = time.perf_counter()
        self._wait({"rollouter": self.rollouter.pause_for_sync.remote()}, "pausing the rollouter")
        t1 = time.perf_counter()
        result = self.transfer(version)
        t2 = time.perf_counter()
        extra = while_paused() if while_paused is not None else {}
        t3 = time.perf_counter()
        self._wait({"rollouter": self.rollouter.resume_after_sync.remote(version)}, "resuming the rollouter")
        t4 = time.perf_counter()
        nbytes = float(result["sender"]["bytes"])
        out = {
            "timing_s/sync_pause": t1 - t0,
            "timing_s/param_sync": result["seconds"],
            "timing_s/sync_group_init": result["init_s"],
            "timing_s/sync_total": (t2 - t0) + (t4 - t3),
            "sync/buckets": float(result["sender"]["buckets"]),
            "sync/bytes": nbytes,
            "sync/gbps": nbytes / max(result["seconds"], 1e-9) / 1e9,
            "sync/engine_ranks": float(self._world - 1),
        }
        if self.verify:
            out["sync/verified_tensors"] = float(len(result["sender"]["checksums"]))
        out.update(extra or {})
        return out

    def close(self) -> None:
        """Leave the group on every member at once (best effort).

        At once, not one side after the other: tearing down an NCCL communicator can wait for
        its peers, and on 4 H200s a close that waited for the engines before telling the
        trainer hung until the call limit (bench/RESULTS.md, GPU runs).
        """
        if self._plan is None:
            return
        try:
            refs = {f"trainer rank {r}": ref for r, ref in enumerate(self.worker_group.leave_weight_sync_async())}
            refs["rollouter"] = self.rollouter.leave_weight_sync.remote()
            self._wait(refs, "leaving the sync group")
        except Exception as exc:  # noqa: BLE001 - closing after a failure must not mask it
            logger.warning("weight sync group close: %s", exc)
        self._plan = None


class GlooCollectiveSync(CollectiveSync):
    """`sync_transport=gloo`: the collective path over host memory (tests, debugging, CPU runs)."""

    backend = "gloo"


def _single_node() -> bool:
    try:
        import ray

        return len([n for n in ray.nodes() if n.get("Alive")]) <= 1
    except Exception:  # noqa: BLE001 - not in a Ray session: one process tree, one node
        return True


def rank_offsets(ranks: Sequence[int], first: int = 1) -> list[int]:
    """Group rank of each engine's first member, engines in order after trainer rank 0."""
    out, at = [], first
    for r in ranks:
        out.append(at)
        at += int(r)
    return out


class EngineGroupEndpoint:
    """The rollout side of the sync group: fans each call out to every engine (replica) at once.

    The RolloutService (and test stand-ins) expose these methods to `CollectiveSync`; joins and
    receives are collective, so all engines must be in flight together.
    """

    def __init__(self, engines: Sequence[Any]) -> None:
        self.sync_engines = list(engines)

    async def weight_sync_ranks(self) -> list[int]:
        return [int(await engine_endpoint(e).weight_sync_ranks()) for e in self.sync_engines]

    async def join_weight_sync(self, host: str, port: int, world_size: int, backend: str, timeout_s: float,
                               name: str) -> None:
        offsets = rank_offsets(await self.weight_sync_ranks())
        await asyncio.gather(*(engine_endpoint(e).join_weight_sync(host, port, rank, world_size, backend, timeout_s,
                                                                   name)
                               for e, rank in zip(self.sync_engines, offsets)))

    async def receive_weights(self, plan: list, version: int, double_buffer: bool = True,
                              verify: bool = False) -> dict[str, dict]:
        """Every engine receives the broadcast (generation paused); results by replica."""
        results = await asyncio.gather(*(engine_endpoint(e).receive_weights(plan, version, double_buffer=double_buffer,
                                                                            verify=verify)
                                         for e in self.sync_engines))
        return {f"replica {i}": r for i, r in enumerate(results)}

    async def leave_weight_sync(self) -> None:
        await asyncio.gather(*(engine_endpoint(e).leave_weight_sync() for e in self.sync_engines))
