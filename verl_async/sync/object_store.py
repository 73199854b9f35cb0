"""`sync_transport=object_store`: buckets travel as Ray objects (any device, any layout; the CPU default).

Trainer ranks: every rank takes part in the gathers; rank 0 yields each bucket as a
`PackedBucket` (raw bytes) through a Ray streaming generator, which pauses after two
unconsumed buckets, so peak host memory stays bounded. Driver: hands each bucket's ref to
the rollout side. Rollout side: gives the same ref to every replica. Engine side: fetches the
bucket in its own process and loads it with the engine's `update_weights`. The tensors never
pass through the driver.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

from verl_async.sync.buckets import PackedBucket, bucketize
from verl_async.sync.driver import SyncDriver, SyncError
from verl_async.sync.ports import EngineHalf, RolloutHalf

FAMILY = "object_store"


# ---------------------------------------------------------------------------------------- trainer rank
class TrainerSide:
    def __init__(self, rank: Any) -> None:
        self.rank = rank

    def weight_buckets(self, bucket_bytes: int, dtype: Optional[str] = None) -> Iterator[PackedBucket]:
        """Buckets of (HF name, tensor) of at most `bucket_bytes` (a larger tensor travels alone); rank 0 yields."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        for bucket in bucketize(self.rank.iter_full_params(self.rank.sync_dtype(dtype)), bucket_bytes):
            yield PackedBucket(bucket)  # raw bytes: the object store moves them without pickling tensors


def bucket_refs(worker_group: Any, bucket_bytes: int, dtype: Optional[str] = None) -> Iterator[Any]:
    """ObjectRefs of rank 0's weight buckets, produced while every rank takes part in the gathers.

    A rank that produces nothing for `trainer.worker_timeout_s` fails the sync; a consumer that
    stops early still lets every rank finish its gathers (none is left blocked in a collective).
    """
    import ray

    gens = worker_group.weight_sync_refs(FAMILY, "weight_buckets", int(bucket_bytes), dtype, streaming=True)
    timeout = worker_group.settings.worker_timeout_s
    stuck = False
    try:
        while True:
            ready, _ = ray.wait([gens[0]], timeout=timeout)
            if not ready:
                stuck = True
                worker_group.mark_broken("weight sync timed out on rank 0")
                raise SyncError(f"{worker_group.name}: rank 0 produced no weight bucket within {timeout:.0f}s "
                                "(trainer.worker_timeout_s)")
            try:
                yield next(gens[0])
            except StopIteration:
                break
    finally:
        # A consumer that stopped early leaves rank 0 paused mid-model and the others blocked in its
        # gathers: drain rank 0, then wait for the other ranks (they yield nothing).
        if not stuck:
            for rank, gen in enumerate(gens):
                for ref in gen:
                    worker_group.wait([ref], f"weight_buckets (rank {rank})")


def full_weights(worker_group: Any, bucket_bytes: int = 256 << 20, dtype: Optional[str] = None) -> Iterator[tuple]:
    """(HF name, full CPU tensor) pairs of the current policy, one bucket in memory at a time."""
    for ref in bucket_refs(worker_group, bucket_bytes, dtype):
        yield from worker_group.wait([ref], "weight bucket")[0]


def push_to_waiting_replicas(worker_group: Any, rollouter: Any, version: int, bucket_bytes: int,
                             wait: Callable[[Any, str], Any]) -> int:
    """The current weights (`version`) to the restarted replicas that wait for them, and to them alone: generation
    goes on on the others (rollout/healing.py). Any transport's run may use it: every rank has this half.
    `wait(ref, what)` answers a Rollouter call within the caller's deadline. Returns how many rejoined."""
    if not wait(rollouter.heal_begin.remote(version), "the Rollouter's heal push"):
        return 0
    for ref in bucket_refs(worker_group, bucket_bytes):
        wait(rollouter.heal_load.remote([ref], version), "the Rollouter's heal push")
    return int(wait(rollouter.heal_end.remote(version), "the Rollouter's heal push"))


# ---------------------------------------------------------------------------------------- engines
def _fetch(refs: Sequence[Any]) -> Iterator[Any]:
    """Fetch weight buckets one at a time (peak extra memory: one bucket), in the engine's loading thread
    (through the ref's future: no blocking ray.get inside the replica's async actor)."""
    import ray

    from verl_async.utils.waiting import resolve

    for ref in refs:
        yield resolve(ref) if isinstance(ref, ray.ObjectRef) else ref


class EngineSide(EngineHalf):
    async def load(self, refs: list, *, version: int) -> None:
        await self.engine.update_weights(_fetch(refs), version)


class RolloutSide(RolloutHalf):
    """Every replica gets the same refs (each fetches the bucket itself)."""

    family, engine_half = FAMILY, EngineSide
    tolerates_lost = True  # each replica fetches on its own: one that died leaves the others' load whole

    async def load(self, refs: list, *, version: int) -> None:
        await self.each("load", list(refs), version=version)


# ---------------------------------------------------------------------------------------- driver
class ObjectStoreSync(SyncDriver):
    """Rank 0 puts the buckets, the replicas fetch them one at a time."""

    family = FAMILY

    def __init__(self, worker_group: Any, rollouter: Any, *, bucket_bytes: int, timeout_s: float = 600.0,
                 **_: Any) -> None:
        super().__init__(worker_group, rollouter, bucket_bytes=bucket_bytes, timeout_s=timeout_s)

    def transfer(self, version: int) -> dict[str, float]:
        buckets = 0
        for ref in bucket_refs(self.worker_group, self.bucket_bytes):
            self.rollout("load", f"loading bucket {buckets}", [ref], version=version)
            buckets += 1
        return {"sync/buckets": float(buckets)}
