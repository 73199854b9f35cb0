"""Collective weight sync: trainer rank 0 broadcasts bucketed weights to every engine rank.

Transports `nccl` (CUDA), `hccl` (NPU) and `gloo` (any device through host memory; the
test/debug transport) all run this module. One sync group spans trainer rank 0 (rank 0
of the group, the sender) and every engine rank (one per native replica, one per
tensor-parallel worker of a vLLM replica). It is built across Ray actors WITHOUT a global
`init_process_group`: rank 0 hosts a `TCPStore` on a free port, every member builds the
backend directly on a `PrefixStore` of it (`ProcessGroupNCCL` / `ProcessGroupGloo` /
torch_npu's `ProcessGroupHCCL`), like vLLM's `stateless_init_torch_distributed_process_group`.
So it lives beside the trainer's FSDP group and vLLM's own groups without touching them.

A sync moves a *plan* (verl_async/sync/buckets.py): buckets of (HF name, dtype, full shape,
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

Halves: `TrainerSide` (every rank gathers, rank 0 hosts the store and sends), `RolloutSide`
(fans each step out to every replica at once: joins and receives are collective),
`engine_side(engine)` (an in-process engine is one member; an engine whose ranks are worker
processes, vLLM, makes each worker a member through `call_workers`, see
rollout/vllm_worker.py), and the driver `CollectiveSync`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence

import torch

from verl_async.sync.buckets import (Bucket, bucket_view, check_exhausted, compare_checksums, fill_bucket,
                                     loaded_checksums, max_bucket_bytes, plan_for, plan_from_wire, plan_to_wire,
                                     tensor_checksum)
from verl_async.sync.driver import SyncDriver, SyncError
from verl_async.sync.ports import EngineHalf, RolloutHalf, engine_call, innermost

logger = logging.getLogger("verl_async.sync")

FAMILY = "collective"

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
        t_gather += fill_bucket(buf, bucket, tensors, checksums if verify else None)
        pending[slot] = group.broadcast(buf[: bucket.nbytes])
        sent += bucket.nbytes
    for work in pending:
        if work is not None:
            work.wait()
    check_exhausted(tensors)
    _synchronize(device)
    return {"bytes": sent, "buckets": len(plan), "checksums": checksums, "gather_s": t_gather}


def sync_phases(sender: dict[str, Any], receivers: dict[str, Any]) -> dict[str, float]:
    """Where a collective sync's seconds went: the trainer's gathers of full tensors (`gather_s`, inside its send), its
    whole send (gathers, bucket copies, broadcasts), and the slowest replica's receive with its weight load."""
    out = {}
    if "gather_s" in sender:
        out["timing_s/sync_gather"] = float(sender["gather_s"])
    if "seconds" in sender:
        out["timing_s/sync_send"] = float(sender["seconds"])
    received = [float(r["seconds"]) for r in receivers.values() if isinstance(r, dict) and "seconds" in r]
    if received:
        out["timing_s/sync_receive_load"] = max(received)
    return out


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


# ---------------------------------------------------------------------------------------- engines
class LocalEngineSide(EngineHalf):
    """Sync-group member for an in-process engine whose `update_weights` takes (name, tensor) buckets.

    The receive generator is handed to `engine.update_weights`, so the blocking receives run
    where the engine consumes weights (the native engine: its worker thread) and the event
    loop stays free.
    """

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.group: Optional[WeightSyncGroup] = None

    async def ranks(self) -> int:
        return 1

    async def join(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                   name: str = "0") -> None:
        def join() -> WeightSyncGroup:
            group = WeightSyncGroup(backend, host, port, rank, world_size, timeout_s, name=name)
            group.handshake()
            return group

        await self.leave()
        self.group = await asyncio.to_thread(join)

    async def receive(self, plan_wire: Sequence, *, version: int, double_buffer: bool = True,
                      verify: bool = False) -> dict[str, Any]:
        if self.group is None:
            raise SyncError("weight sync: receive before join")
        plan = plan_from_wire(plan_wire)
        received: dict[str, str] = {}
        t0 = time.perf_counter()
        stream = receive_buckets(self.group, plan, double_buffer=double_buffer, verify=verify, checksums=received)
        await self.engine.update_weights(stream, version)
        out: dict[str, Any] = {"checksums": received, "seconds": time.perf_counter() - t0}
        if verify:
            out["loaded_checksums"] = loaded_checksums(self.engine, plan)
        return out

    async def leave(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class WorkerRanksSide(EngineHalf):
    """An engine whose ranks are worker processes (vLLM): each worker joins the group itself.

    The engine offers `worker_ranks`, `call_workers(method, *args, timeout=...)` (one call on
    every worker, results in rank order) and `after_load(version)`; the workers run the
    `verl_async_*` methods of rollout/vllm_worker.py.
    """

    async def ranks(self) -> int:
        return int(self.engine.worker_ranks)

    async def join(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                   name: str = "0") -> None:
        await self.engine.call_workers("verl_async_join_weight_sync", host, port, rank, world_size, backend,
                                       timeout_s, name, timeout=timeout_s)

    async def receive(self, plan_wire: Sequence, *, version: int, double_buffer: bool = True,
                      verify: bool = False) -> dict[str, Any]:
        results = await self.engine.call_workers("verl_async_receive_weights", plan_wire, double_buffer, verify)
        await self.engine.after_load(version)
        first = results[0]
        if verify:  # every TP worker received the same bytes
            for other in results[1:]:
                if other["checksums"] != first["checksums"]:
                    bad = [k for k in first["checksums"] if other["checksums"].get(k) != first["checksums"][k]]
                    raise SyncError(f"vLLM worker rank {other['rank']} received different bytes for {bad[:3]}")
        return {"checksums": first["checksums"], "seconds": max(r["seconds"] for r in results)}

    async def leave(self) -> None:
        if getattr(self.engine, "llm", None) is not None:
            await self.engine.call_workers("verl_async_leave_weight_sync", timeout=60)


def engine_side(engine: Any) -> Any:
    """The member half for this engine: its worker processes when it has them, else the engine itself."""
    inner = innermost(engine)
    if hasattr(inner, "call_workers"):
        return WorkerRanksSide(inner)
    return LocalEngineSide(engine)


def rank_offsets(ranks: Sequence[int], first: int = 1) -> list[int]:
    """Group rank of each engine's first member, engines in order after trainer rank 0."""
    out, at = [], first
    for r in ranks:
        out.append(at)
        at += int(r)
    return out


class RolloutSide(RolloutHalf):
    """The rollout side of the sync group: fans each step out to every member replica at once.

    Joins and receives are collective, so all members must be in flight together. The members
    are the replicas in rotation when the group formed; `members_changed` tells the driver to
    form a new group when one has left the rotation since (its engine would never receive).
    """

    family, engine_half = FAMILY, staticmethod(engine_side)

    def __init__(self, owner: Any) -> None:
        super().__init__(owner)
        self.members: list = []

    async def ranks(self) -> list[int]:
        return [int(r) for r in await self.each("ranks")]

    async def join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float, name: str) -> None:
        self.members = self.engines()
        offsets = rank_offsets([int(r) for r in await self.each("ranks", engines=self.members)])
        await asyncio.gather(*(engine_call(e, FAMILY, engine_side, "join", host, port, rank, world_size, backend,
                                           timeout_s, name)
                               for e, rank in zip(self.members, offsets)))

    async def members_changed(self) -> bool:
        return [id(e) for e in self.engines()] != [id(e) for e in self.members]

    async def receive(self, plan: list, *, version: int, double_buffer: bool = True,
                      verify: bool = False) -> dict[str, dict]:
        """Every member receives the broadcast (generation paused); results by replica."""
        results = await self.each("receive", plan, version=version, double_buffer=double_buffer, verify=verify,
                                  engines=self.members)
        return {f"replica {i}": r for i, r in enumerate(results)}

    async def leave(self) -> None:
        members, self.members = self.members, []
        await self.each("leave", engines=members)


# ---------------------------------------------------------------------------------------- trainer rank
class TrainerSide:
    """What a trainer rank holds: the store and group on rank 0, nothing on the others.

    The rank provides `rank`, `sync_dtype(dtype)`, `full_param_shapes()` (HF name, full shape, in
    `iter_full_params` order: the plan comes from metadata alone, no gather) and
    `iter_full_params(dtype, to_cpu=False)` (collective: every rank iterates).
    """

    def __init__(self, rank: Any) -> None:
        self.owner = rank
        self.rank = int(rank.rank)
        self.store: Any = None
        self.group: Optional[WeightSyncGroup] = None

    def plan(self, bucket_bytes: int, dtype: Optional[str] = None) -> list:
        """The bucket plan (names, dtypes, full shapes, offsets) from metadata alone: no gather."""
        return plan_to_wire(plan_for(self.owner, bucket_bytes, dtype, transport="collective"))

    def address(self, local_only: bool, timeout_s: float) -> tuple[str, int]:
        """Rank 0 starts a fresh TCPStore server; returns where the group meets."""
        self.leave()
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

    def send(self, plan_wire: Sequence, double_buffer: bool = True, verify: bool = False,
             dtype: Optional[str] = None) -> dict[str, Any]:
        """Every rank gathers; rank 0 broadcasts the buckets of `plan` to the sync group."""
        if self.rank == 0 and self.group is None:
            raise SyncError("weight sync: send before the group was joined")
        tensors = self.owner.iter_full_params(self.owner.sync_dtype(dtype), to_cpu=False)
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

    def leave(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.store = None


# ---------------------------------------------------------------------------------------- driver
class CollectiveSync(SyncDriver):
    """The driver over a collective group (`nccl` on CUDA, `hccl` on NPU, `gloo` over host memory).

    The group is formed on the first push (timed apart as `timing_s/sync_group_init`) and
    reused. `bucket_bytes` is the bucket size (`async_training.checkpoint_engine.
    device_buffer_size_M`), `double_buffer` overlaps gather and broadcast
    (`checkpoint_engine.overlap_broadcast_and_consume`), `verify` checks every tensor's
    checksum on every engine rank (costs a pass over the weights on both sides).
    """

    family = FAMILY
    backend: Optional[str] = None  # None: from the trainer's device (nccl / hccl)

    def __init__(self, worker_group: Any, rollouter: Any, *, bucket_bytes: int, timeout_s: float = 600.0,
                 double_buffer: bool = True, verify: bool = False, backend: Optional[str] = None) -> None:
        super().__init__(worker_group, rollouter, bucket_bytes=bucket_bytes, timeout_s=timeout_s, verify=verify)
        self.double_buffer = bool(double_buffer)
        self.backend = backend or self.backend or self._backend_for(worker_group)
        self._plan: Optional[list] = None
        self._world = 0
        self._generation = 0

    @staticmethod
    def _backend_for(worker_group: Any) -> str:
        from verl_async.utils import device as device_layer

        kind = str(worker_group.settings.device)
        if kind == "cpu":
            raise SyncError("async_training.sync_transport: nccl/hccl need trainer.device=cuda/npu; "
                            "use gloo (collective over host memory) or object_store on CPU")
        return device_layer.dist_backend(kind)

    def _ranks(self, step: str, *args: Any, ranks: Optional[list[int]] = None) -> dict[str, Any]:
        refs = self.worker_group.weight_sync_refs(FAMILY, step, *args, ranks=ranks)
        return {f"trainer rank {r}": ref for r, ref in zip(ranks or range(len(refs)), refs)}

    def _rollout_ref(self, step: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"rollouter": self.rollouter.weight_sync.remote(FAMILY, step, *args, **kwargs)}

    # -------------------------------------------------------------- group
    def _ensure_group(self) -> float:
        if self._broken:
            raise SyncError(f"parameter sync: the sync group is unusable after an earlier failure ({self._broken})")
        if self._plan is not None and self.rollout("members_changed", "checking the group's members"):
            logger.warning("weight sync: a replica left the rotation since the %s group formed; forming a new one",
                           self.backend)
            self.close()
        if self._plan is not None:
            return 0.0
        t0 = time.perf_counter()
        self._plan = self.wait(self._ranks("plan", self.bucket_bytes, ranks=[0]), "planning the buckets")[
            "trainer rank 0"]
        ranks = self.rollout("ranks", "counting engine ranks")
        self._world = 1 + int(sum(ranks))
        local_only = bool(getattr(self.worker_group.settings, "nnodes", 1) == 1) and _single_node()
        host, port = self.wait(self._ranks("address", local_only, self.timeout_s, ranks=[0]),
                               "starting the rendezvous store")["trainer rank 0"]
        self._generation += 1
        name = f"{self._generation}-{port}"
        refs = self._ranks("join", self._world, self.backend, self.timeout_s, name, ranks=[0])
        refs.update(self._rollout_ref("join", host, port, self._world, self.backend, self.timeout_s, name))
        self.wait(refs, f"forming the {self.backend} sync group of {self._world} ranks")
        return time.perf_counter() - t0

    def replan(self, bucket_bytes: int) -> None:
        """New bucket size for the next pushes, keeping the formed group (re-forming one costs a rendezvous)."""
        self.bucket_bytes = int(bucket_bytes)
        if self._plan is not None:
            self._plan = self.wait(self._ranks("plan", self.bucket_bytes, ranks=[0]), "planning the buckets")[
                "trainer rank 0"]

    # -------------------------------------------------------------- one sync
    def transfer(self, version: int) -> dict[str, float]:
        """Move all buckets to every engine rank (generation must be paused); returns the sync metrics."""
        init_s = self._ensure_group()
        t0 = time.perf_counter()
        refs = self._ranks("send", self._plan, self.double_buffer, self.verify)
        refs.update(self._rollout_ref("receive", self._plan, version=version, double_buffer=self.double_buffer,
                                      verify=self.verify))
        out = self.wait(refs, f"broadcasting the weights (version {version})")
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
        nbytes = float(sender["bytes"])
        metrics = {
            "timing_s/param_sync": seconds,
            "timing_s/sync_group_init": init_s,
            "sync/buckets": float(sender["buckets"]),
            "sync/bytes": nbytes,
            "sync/gbps": nbytes / max(seconds, 1e-9) / 1e9,
            "sync/engine_ranks": float(self._world - 1),
        }
        metrics.update(sync_phases(sender, receivers))
        if self.verify:
            metrics["sync/verified_tensors"] = float(len(sender["checksums"]))
        return metrics

    def close(self) -> None:
        """Leave the group on every member at once (best effort).

        At once, not one side after the other: tearing down an NCCL communicator can wait for
        its peers, and on 4 H200s a close that waited for the engines before telling the
        trainer hung until the call limit (bench/RESULTS.md, GPU runs).
        """
        if self._plan is None:
            return
        try:
            refs = self._ranks("leave", ranks=[0])
            refs.update(self._rollout_ref("leave"))
            self.wait(refs, "leaving the sync group")
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
