"""Engine replicas that heal: a lost replica restarts, gets the current weights alone, and rejoins.

A replica is lost when its process dies (`kill -9`, an OOM, a CUDA fault that ends it, its node
going away: the proxy raises `ReplicaLost`), when it fails `rollout.max_consecutive_engine_failures`
requests in a row (a broken device: it is killed), or when it holds requests and makes no
progress for `rollout.progress_timeout_s` (a hang: it is killed). Then:

1. it leaves the rotation (`ReplicaHealth.down`); its requests in flight go to the other replicas,
   continued from the tokens the Rollouter already holds (partial rollout: each token keeps the
   version that sampled it), so no group is lost or counted twice;
2. Ray restarts its actor in the same placement bundle (`max_restarts` of the actor; on another
   node when the bundle's node died and the placement group moved it); the restarted replica is
   fenced (rollout/replica.py: it serves nothing with the model's first weights);
3. it waits for the current weights: the trainer pushes them to the waiting replicas alone the
   next time it waits for groups with weights equal to the engines' version
   (`Trainer.serve_replica_heals`), or the next weight sync includes it; a run without a trainer
   (`debug.rollout_only`) has nothing to wait for;
4. with those weights it rejoins the rotation.

Each replica restarts at most `rollout.max_replica_restarts` times; the next loss retires it, and
the run goes on with the others while one is left (or restarting). Every restart is an event
(`HealEvent`): cause, seconds to the new process, seconds to rejoin; `fault/*` metrics and the end
summary report them.

The Ray-facing steps (restarting an actor, loading weights into one replica) are the owner's
(rollout/service.py); this class is plain asyncio and is driven in-process by tests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, Optional

from verl_async.errors import root_cause

logger = logging.getLogger("verl_async.rollout")

# restart(index, engine, kill) -> the new engine proxy (its process restarted and loaded the model)
Restart = Callable[[int, Any, bool], Awaitable[Any]]
# retire(index, engine): end the replica for good (no further restart)
Retire = Callable[[int, Any], None]


@dataclass
class HealEvent:
    replica: int
    cause: str
    restart: int  # 1: the replica's first restart
    detected_at: float  # seconds since the run started
    restarted_s: Optional[float] = None  # detection -> the new process answers
    rejoined_s: Optional[float] = None  # detection -> serving again with the current weights
    version: Optional[int] = None  # the weights it rejoined with
    outcome: str = "restarting"  # restarting | awaiting weights | rejoined | retired


class ReplicaHealer:
    """Heals the replicas of one Rollouter (`rollouter.engines`, `.health`); see the module docstring."""

    def __init__(self, rollouter: Any, *, max_restarts: int, restart: Restart, retire: Optional[Retire] = None,
                 needs_weights: bool = True, clock: Optional[Callable[[], float]] = None) -> None:
        self.rollouter = rollouter
        self.max_restarts = int(max_restarts)
        self._restart = restart
        self._end = retire
        self.needs_weights = bool(needs_weights)
        self.clock = clock or time.monotonic
        self._start = self.clock()
        count = len(rollouter.engines)
        self.restarts = [0] * count
        self.events: list[HealEvent] = []
        self.awaiting: dict[int, tuple[Any, HealEvent, float]] = {}  # index -> (new engine, event, t detected)
        self._tasks: dict[int, asyncio.Task] = {}
        self._push: Optional[tuple[int, list[int]]] = None  # (version, replicas) of the trainer's heal push

    # ------------------------------------------------------------------ losing one
    def lost(self, index: int, why: str, *, kill: bool = False, engine: Any = None) -> bool:
        """Replica `index` is lost (`kill`: it still runs, broken or hung). False when this report is stale (about
        an engine proxy no longer current, or a replica already down or retired)."""
        ro = self.rollouter
        if engine is not None and ro.engines[index] is not engine:
            return False  # a late report about the process that was already replaced
        if not ro.health.take_down(index, why):
            return False
        self.restarts[index] += 1
        event = HealEvent(index, why, self.restarts[index], round(self.clock() - self._start, 3))
        self.events.append(event)
        if self.restarts[index] > self.max_restarts:
            self._retire(index, event)
            return True
        self._tasks[index] = asyncio.ensure_future(self._heal(index, ro.engines[index], kill, event))
        return True

    async def _heal(self, index: int, engine: Any, kill: bool, event: HealEvent) -> None:
        t0 = self.clock()
        try:
            new = await self._restart(index, engine, kill)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a restart that fails retires the replica, the run goes on
            self._retire(index, event, why=f"its restart failed: {root_cause(exc)}")
            return
        finally:
            self._tasks.pop(index, None)
        event.restarted_s = round(self.clock() - t0, 3)
        event.outcome = "awaiting weights"
        self.awaiting[index] = (new, event, t0)
        logger.warning("engine replica %d restarted in %.1f s (restart %d of %d); %s", index, event.restarted_s,
                       event.restart, self.max_restarts,
                       "it waits for the current weights" if self.needs_weights else "it rejoins")
        if not self.needs_weights:
            await self.rejoin(index, None)

    def _retire(self, index: int, event: HealEvent, *, why: Optional[str] = None) -> None:
        ro = self.rollouter
        reason = why or (event.cause if self.max_restarts == 0 else
                         f"lost again after {self.max_restarts} restart(s) (rollout.max_replica_restarts): {event.cause}")
        event.outcome = "retired"
        self.awaiting.pop(index, None)
        ro.health.retire(index, reason)
        ro.counters.replicas_out_of_rotation = len(ro.health.out)
        if self._end is not None:
            try:
                self._end(index, ro.engines[index])
            except Exception as exc:  # noqa: BLE001 - it may be gone already
                logger.warning("ending retired replica %d: %s", index, exc)
        ro.replicas_changed()

    # ------------------------------------------------------------------ weights and rejoining
    def awaiting_weights(self) -> list[int]:
        """Restarted replicas that wait for the current weights."""
        return sorted(self.awaiting)

    def engine_of(self, index: int) -> Any:
        """The engine proxy a replica that waits for weights gets them through."""
        return self.awaiting[index][0]

    async def rejoin(self, index: int, version: Optional[int]) -> bool:
        """Replica `index` holds the weights of `version` (None: no trainer, nothing to load): it serves again."""
        if index not in self.awaiting:
            return False
        new, event, t0 = self.awaiting.pop(index)
        ro = self.rollouter
        try:
            await new.rejoin()
        except Exception as exc:  # noqa: BLE001 - it died again before serving: heal it again
            self.awaiting[index] = (new, event, t0)
            ro.engines[index] = new
            ro.health.back(index)
            self.lost(index, f"lost before it rejoined: {exc}", engine=new)
            return False
        ro.engines[index] = new
        ro.health.back(index)
        event.rejoined_s = round(self.clock() - t0, 3)
        event.version = version
        event.outcome = "rejoined"
        logger.warning("engine replica %d rejoined %.1f s after it was lost%s", index, event.rejoined_s,
                       "" if version is None else f", with the weights of version {version}")
        ro.replicas_changed()
        return True

    # ------------------------------------------------------------------ the trainer's push to waiting replicas
    def begin_push(self, version: int) -> list[int]:
        """The trainer starts pushing `version` to the replicas that wait now (they alone get it)."""
        targets = self.awaiting_weights()
        self._push = (int(version), targets) if targets else None
        return targets

    async def push_bucket(self, load: Callable[[Any], Awaitable[Any]]) -> None:
        """Load one bucket into each target (`load(engine)`); a target lost on the way is healed again."""
        if self._push is None:
            return
        version, targets = self._push
        engines = [(i, self.awaiting[i][0]) for i in targets if i in self.awaiting]
        results = await asyncio.gather(*(load(e) for _, e in engines), return_exceptions=True)
        for (index, engine), result in zip(engines, results):
            if isinstance(result, BaseException):
                self.lost_awaiting(index, engine, f"lost while loading weights: {result}")
        self._push = (version, [i for i in targets if i in self.awaiting])

    async def end_push(self, complete: Callable[[Any], Awaitable[bool]]) -> int:
        """Targets whose load is complete (`complete(engine)`: every parameter written) rejoin; returns how many."""
        if self._push is None:
            return 0
        version, targets = self._push
        self._push = None
        joined = 0
        for index in targets:
            if index not in self.awaiting:
                continue
            engine = self.awaiting[index][0]
            try:
                ok = await complete(engine)
            except Exception as exc:  # noqa: BLE001
                self.lost_awaiting(index, engine, f"lost while loading weights: {exc}")
                continue
            if ok:
                joined += int(await self.rejoin(index, version))
        return joined

    def lost_awaiting(self, index: int, engine: Any, why: str) -> None:
        _, event, _ = self.awaiting.pop(index)
        event.outcome = "lost again"
        self.rollouter.engines[index] = engine
        self.rollouter.health.back(index)  # down again below, as a new loss
        self.lost(index, why, engine=engine)

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> dict[str, float]:
        """fault/*: replica processes restarted so far, replicas retired and down, time to rejoin (last and max)."""
        rejoined = [e.rejoined_s for e in self.events if e.rejoined_s is not None]
        out = {
            "fault/replica_restarts": float(sum(e.restarted_s is not None for e in self.events)),
            "fault/replicas_retired": float(sum(e.outcome == "retired" for e in self.events)),
            "fault/replicas_down": float(len(self.rollouter.health.down)),
        }
        if rejoined:
            out["fault/replica_rejoin_s"] = float(rejoined[-1])
            out["fault/replica_rejoin_s_max"] = float(max(rejoined))
        return out

    def summary(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.events]

    def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        self._tasks.clear()
