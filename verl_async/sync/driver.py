"""What every transport's driver does alike: pause -> (before transfer) -> transfer -> (while paused) -> resume.

A driver lives in the Trainer's process and holds two handles: the worker group (its ranks
run the transport's trainer half) and the rollout side (the RolloutService or a `SyncTarget`
actor, which fans each step out to the engine replicas). A transport only defines
`transfer(version)`; pausing, resuming, the timings and the waits with deadlines are here.

Failures never hang: every wait has `timeout_s`, and a failure surfaces as `SyncError` naming
the member (a trainer rank or the rollout side) and the step; when an actor died behind it, the
error keeps Ray's as its `cause`, so the run's message names the actor that died.
"""

from __future__ import annotations

import abc
import time
from typing import Any, Callable, Optional

from verl_async.utils.waiting import WaitTimeout, finished_in_turn

TIMEOUT_KEY = "async_training.sync_timeout_s"


class SyncError(RuntimeError):
    pass


class SyncDriver(abc.ABC):
    """Base of `ObjectStoreSync`, `CollectiveSync` and `CudaIpcSync`; see the module docstring."""

    family: str = ""  # the transport's module in verl_async/sync/ (object_store | collective | cuda_ipc)

    def __init__(self, worker_group: Any, rollouter: Any, *, bucket_bytes: int, timeout_s: float = 600.0,
                 verify: bool = False) -> None:
        self.worker_group = worker_group
        self.rollouter = rollouter
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = float(timeout_s)
        self.verify = bool(verify)
        self.last: dict[str, Any] = {}
        self._broken: Optional[str] = None

    # -------------------------------------------------------------- waiting
    def wait(self, refs: dict[str, Any], what: str) -> dict[str, Any]:
        """Wait for named refs; the first failure or the deadline raises SyncError naming who and what.

        When an actor died behind the failure (an engine replica, a rank), the SyncError keeps Ray's
        error as its `cause`, so the run's one-line message (errors.root_cause) names the actor that died.
        """
        import ray

        out: dict[str, Any] = {}
        try:
            for name, ref, left in finished_in_turn(refs, self.timeout_s):
                try:
                    out[name] = ray.get(ref, timeout=left)
                except Exception as exc:  # noqa: BLE001 - re-raised as SyncError naming the member
                    self._broken = f"{name} failed in {what}"
                    error = SyncError(f"parameter sync: {name} failed in {what}: {type(exc).__name__}: {exc}")
                    if isinstance(exc, ray.exceptions.RayActorError):
                        error.cause = exc
                    raise error from exc
        except WaitTimeout as late:
            self._broken = f"{what} timed out on {late.pending}"
            raise SyncError(f"parameter sync: {what} did not finish on {late.pending} within {self.timeout_s:.0f}s "
                            f"(a member is dead or stuck; raise {TIMEOUT_KEY} if it is only slow)") from None
        return out

    def rollout(self, step: str, what: str, *args: Any, **kwargs: Any) -> Any:
        """Run one step of this transport's rollout half (fanned out to every replica) and wait for it."""
        ref = self.rollouter.weight_sync.remote(self.family, step, *args, **kwargs)
        return self.wait({"rollouter": ref}, what)["rollouter"]

    # -------------------------------------------------------------- one sync
    @abc.abstractmethod
    def transfer(self, version: int) -> dict[str, float]:
        """Move every weight to every engine (generation is paused); returns metrics (at least sync/buckets)."""

    def push(self, version: int, while_paused: Optional[Callable[[], dict]] = None,
             before_transfer: Optional[Callable[[], dict]] = None) -> dict[str, float]:
        """One full sync to `version`. `before_transfer` runs once generation is paused, before any weight moves
        (the trainer waits there for a validation still running on the old weights); `while_paused` runs after
        the load, before generation resumes (checkpoint). Both return metrics."""
        t0 = time.perf_counter()
        self.wait({"rollouter": self.rollouter.pause_for_sync.remote()}, "pausing the rollouter")
        paused = time.perf_counter()
        settled = before_transfer() if before_transfer is not None else {}
        t1 = time.perf_counter()
        moved = self.transfer(version)
        self.check_coverage(version)
        t2 = time.perf_counter()
        extra = while_paused() if while_paused is not None else {}
        t3 = time.perf_counter()
        self.wait({"rollouter": self.rollouter.resume_after_sync.remote(version)}, "resuming the rollouter")
        t4 = time.perf_counter()
        out = {
            "timing_s/sync_pause": paused - t0,
            "timing_s/param_sync": t2 - t1,
            "timing_s/sync_total": (t2 - t0) + (t4 - t3),
        }
        out.update(moved)
        out.update(settled or {})
        out.update(extra or {})
        return out

    def check_coverage(self, version: int) -> None:
        """Every engine parameter was written by this sync: a name the trainer never sends (a mapping gap)
        would otherwise keep its old value on the engine, silently."""
        missing = self.rollout("unwritten", f"checking that version {version} wrote every weight", version=version)
        if missing:
            who, names = next(iter(missing.items()))
            raise SyncError(f"parameter sync: version {version} left {len(names)} parameter(s) of {who} unwritten "
                            f"(the trainer sent no tensor of that name): {names[:5]}"
                            + (f"; {len(missing) - 1} other replica(s) too" if len(missing) > 1 else ""))

    def close(self) -> None:
        """Release what the transport holds between syncs (a collective group); nothing by default."""

