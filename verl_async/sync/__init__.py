"""Weight sync: the trainer's weights onto every engine replica, version += 1 (docs/architecture.md).

A sync is: pause generation -> move the weights bucket by bucket -> (checkpoint, validation
while nothing generates) -> resume. Each transport (`async_training.sync_transport`) is one
module here, holding all of its halves:

| transport                 | module          | moves the bytes by                                      |
|---------------------------|-----------------|---------------------------------------------------------|
| object_store (CPU default)| object_store.py | Ray objects: rank 0 puts, each replica fetches          |
| nccl / hccl / gloo        | collective.py   | a broadcast from trainer rank 0 to every engine rank    |
| cuda_ipc (auto colocated) | cuda_ipc.py     | each colocated engine maps its GPU's trainer rank's buffers |

Halves: `TrainerSide` (runs on each trainer rank), `RolloutSide` (runs in the rollout
service, fans out to the replicas), the engine side (runs beside each engine), and the
driver (runs in the Trainer; `driver.py` has the pause/resume protocol). The actors only
forward: each has one method, `weight_sync(transport, step, ...)`, that calls the functions
below (ports.py says why). Buckets (one definition for all transports) are in buckets.py.
"""

from __future__ import annotations

from typing import Any

from verl_async.sync import collective, cuda_ipc, object_store
from verl_async.sync.driver import TIMEOUT_KEY, SyncDriver, SyncError
from verl_async.sync.ports import engine_call, forget_halves, half_of

# name (the config value) -> driver class
DRIVERS: dict[str, type[SyncDriver]] = {
    "object_store": object_store.ObjectStoreSync,
    "nccl": collective.CollectiveSync,
    "hccl": collective.CollectiveSync,
    "gloo": collective.GlooCollectiveSync,  # the collective path over host memory (tests/debug)
    "cuda_ipc": cuda_ipc.CudaIpcSync,  # colocated engine on the trainer's GPU: device-to-device
}
# family (a driver's module) -> its halves
_MODULES = {"object_store": object_store, "collective": collective, "cuda_ipc": cuda_ipc}
TRAINER_SIDES = {family: module.TrainerSide for family, module in _MODULES.items()}
ROLLOUT_SIDES = {family: module.RolloutSide for family, module in _MODULES.items()}
ENGINE_SIDES = {"object_store": object_store.EngineSide, "collective": collective.engine_side,
                "cuda_ipc": cuda_ipc.EngineSide}

__all__ = ["DRIVERS", "SyncDriver", "SyncError", "TIMEOUT_KEY", "build_sync", "build_sync_from_config", "sync_timeout_s",
           "engine_weight_sync", "rank_weight_sync", "rollout_weight_sync", "engine_call", "forget_halves"]


def _side(table: dict[str, Any], family: str) -> Any:
    if family not in table:
        raise SyncError(f"weight sync: unknown transport family {family!r}; available: {sorted(table)}")
    return table[family]


# ---------------------------------------------------------------------------------------- the actors' one call
def rank_weight_sync(rank: Any, family: str, step: str, *args: Any, **kwargs: Any) -> Any:
    """A trainer rank's `weight_sync`: run `step` of its half of `family` (may return a generator: streaming)."""
    return getattr(half_of(rank, _side(TRAINER_SIDES, family)), step)(*args, **kwargs)


async def rollout_weight_sync(owner: Any, family: str, step: str, *args: Any, **kwargs: Any) -> Any:
    """The rollout actor's `weight_sync` (`owner.sync_engines`: the replicas to fan out to)."""
    return await getattr(half_of(owner, _side(ROLLOUT_SIDES, family)), step)(*args, **kwargs)


async def engine_weight_sync(engine: Any, family: str, step: str, *args: Any, **kwargs: Any) -> Any:
    """An engine replica's `weight_sync`: run `step` of the engine's own half of `family`."""
    return await engine_call(engine, family, _side(ENGINE_SIDES, family), step, *args, **kwargs)


# ---------------------------------------------------------------------------------------- building a driver
def build_sync(transport: str, worker_group: Any, rollouter: Any, **kwargs: Any) -> SyncDriver:
    """The driver for `transport` (a `sync_transport` value) with explicit keyword arguments."""
    if transport not in DRIVERS:
        raise ValueError(f"async_training.sync_transport: unknown transport {transport!r}; available: "
                         f"{sorted(DRIVERS)}")
    return DRIVERS[transport](worker_group, rollouter, **kwargs)


SYNC_TIMEOUT_BASE_S = 600.0


def sync_timeout_s(cfg: Any) -> float:
    """How long one sync step may take (`async_training.sync_timeout_s`; null: derived). Moving the weights
    gets 600 s; with partial_rollout=false the pause first waits for the responses in flight, allowed
    max_response_length more seconds (1 token/s: only a wedged engine is slower)."""
    at = cfg.async_training
    if at.get("sync_timeout_s") is not None:
        return float(at.sync_timeout_s)
    return SYNC_TIMEOUT_BASE_S + (0.0 if at.partial_rollout else float(cfg.data.max_response_length))


def build_sync_from_config(cfg: Any, worker_group: Any, rollouter: Any) -> SyncDriver:
    """The driver the run's config asks for; the transport's own keys are read here."""
    at = cfg.async_training
    transport = str(at.sync_transport)
    kwargs: dict[str, Any] = {"bucket_bytes": int(at.sync_bucket_size_mb) << 20, "timeout_s": sync_timeout_s(cfg)}
    if transport != "object_store":  # the collective and IPC transports read verl's checkpoint_engine keys
        engine = at.checkpoint_engine
        kwargs.update(bucket_bytes=int(engine.device_buffer_size_M) << 20,
                      double_buffer=bool(engine.overlap_broadcast_and_consume))
    return build_sync(transport, worker_group, rollouter, **kwargs)
