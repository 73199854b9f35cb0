"""Parameter synchronisation: trainer weights -> every engine replica, version += 1.

A sync is: pause generation -> move the weights bucket by bucket -> (validation /
checkpoint while nothing generates) -> resume. Transports are chosen by name
(`async_training.sync_transport`): `object_store` (Ray object store; any device, the
CPU default) here; the collective transports `nccl` (CUDA), `hccl` (NPU) and `gloo`
(host memory, any device: tests and debugging) in `sync_collective.py`; `cuda_ipc` (a colocated
engine maps trainer rank 0's device buffers through CUDA IPC) in `sync_ipc.py`.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable, Optional

import ray

TRANSPORTS: dict[str, str] = {
    "object_store": "verl_async.sync:ObjectStoreSync",
    "nccl": "verl_async.sync_collective:CollectiveSync",
    "hccl": "verl_async.sync_collective:CollectiveSync",
    "gloo": "verl_async.sync_collective:GlooCollectiveSync",  # the collective path over host memory (tests/debug)
    "cuda_ipc": "verl_async.sync_ipc:CudaIpcSync",  # colocated engine on the trainer's GPU: device-to-device
}


class SyncError(RuntimeError):
    pass


class ObjectStoreSync:
    """Buckets travel as Ray objects: rank 0 puts them, the replicas fetch them one at a time."""

    def __init__(self, worker_group: Any, rollouter: Any, *, bucket_bytes: int, timeout_s: float = 600.0) -> None:
        self.worker_group = worker_group
        self.rollouter = rollouter
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = timeout_s

    def _get(self, ref: Any, what: str) -> Any:
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise SyncError(f"parameter sync: {what} did not finish within {self.timeout_s:.0f}s") from exc

    def transfer(self, version: int) -> tuple[int, int]:
        """Move all buckets; returns (buckets, bytes)."""
        buckets = nbytes = 0
        for ref in self.worker_group.weight_bucket_refs(self.bucket_bytes):
            self._get(self.rollouter.load_buckets.remote([ref], version), f"loading bucket {buckets}")
            buckets += 1
        return buckets, nbytes

    def push(self, version: int, while_paused: Optional[Callable[[], dict]] = None) -> dict[str, float]:
        """One full sync to `version`; `while_paused` runs after the load, before generation resumes."""
        t0 = time.perf_counter()
        self._get(self.rollouter.pause_for_sync.remote(), "pausing the rollouter")
        t1 = time.perf_counter()
        buckets, _ = self.transfer(version)
        t2 = time.perf_counter()
        extra = while_paused() if while_paused is not None else {}
        t3 = time.perf_counter()
        self._get(self.rollouter.resume_after_sync.remote(version), "resuming the rollouter")
        t4 = time.perf_counter()
        out = {
            "timing_s/sync_pause": t1 - t0,
            "timing_s/param_sync": t2 - t1,
            "timing_s/sync_total": (t2 - t0) + (t4 - t3),
            "sync/buckets": float(buckets),
        }
        out.update(extra or {})
        return out


def build_sync(transport: str, worker_group: Any, rollouter: Any, **kwargs: Any) -> Any:
    if transport not in TRANSPORTS:
        raise ValueError(f"async_training.sync_transport: unknown transport {transport!r}; available: {sorted(TRANSPORTS)}")
    module_name, _, attr = TRANSPORTS[transport].partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"async_training.sync_transport={transport!r} is not available here ({exc})") from exc
    return cls(worker_group, rollouter, **kwargs)
