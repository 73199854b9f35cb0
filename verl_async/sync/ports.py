"""How a transport step reaches the object that runs it: one generic call per actor.

Every actor on the way (a trainer rank, the rollout service, an engine replica) has ONE
method, `weight_sync(transport, step, *args, **kwargs)`, that runs `step` of its own half of
that transport (verl_async/sync/__init__.py maps the names). The halves are plain objects
kept per owner, so a collective member keeps its group from one sync to the next. Proxies
(a `RemoteEngine`) forward the same call to their actor; an in-process engine gets its half
here. A new transport therefore adds no method to any actor.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Callable, Optional

from verl_async.errors import ReplicaLost

_halves: "weakref.WeakKeyDictionary[Any, dict[Callable, Any]]" = weakref.WeakKeyDictionary()


def half_of(owner: Any, make: Callable[[Any], Any]) -> Any:
    """`owner`'s half built by `make` (a class or factory taking the owner), created on first use and kept."""
    kept = _halves.setdefault(owner, {})
    if make not in kept:
        kept[make] = make(owner)
    return kept[make]


def forget_halves(owner: Any) -> None:
    """Drop what `owner` holds (tests and shutdown; a collective half should have left its group first)."""
    _halves.pop(owner, None)


def innermost(engine: Any) -> Any:
    """The engine under wrappers that pass calls through (`DelegatingEngine.inner`, e.g. fault injection)."""
    while hasattr(engine, "inner"):
        engine = engine.inner
    return engine


async def engine_call(engine: Any, family: str, make: Callable[[Any], Any], step: str, *args: Any,
                      **kwargs: Any) -> Any:
    """Run `step` of transport `family` for one engine: a proxy forwards to its actor, a local engine runs its half."""
    forward = getattr(engine, "weight_sync", None)
    if forward is not None:
        return await forward(family, step, *args, **kwargs)
    return await getattr(half_of(engine, make), step)(*args, **kwargs)


class EngineHalf:
    """Base of every transport's engine side: holds the engine, and checks a sync's coverage."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def unwritten(self, *, version: int) -> list[str]:
        """Parameters of the engine that no load under `version` wrote ([] where the engine cannot tell: vLLM)."""
        check = getattr(innermost(self.engine), "unwritten_parameters", None)
        return list(check(version)) if check is not None else []


class RolloutHalf:
    """Base of every transport's rollout side: fans a step out to the replicas in `owner.sync_engines`.

    `tolerates_lost`: a replica lost in a step (`ReplicaLost`: its process died) is handed to
    `owner.member_lost(engine, exc)`, which takes it out of this sync (it is healed and gets the
    weights by itself, rollout/healing.py), and the step goes on with the others. Only transports
    whose members load independently may tolerate it (object_store); in a collective, a lost
    member breaks the step for everyone.
    """

    family: str = ""
    engine_half: Callable[[Any], Any] = EngineHalf
    tolerates_lost: bool = False

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def engines(self) -> list:
        return list(self.owner.sync_engines)

    async def each(self, step: str, *args: Any, engines: Optional[list] = None, **kwargs: Any) -> list:
        """`step` on every replica at once; results in replica order (None for a replica lost, when tolerated)."""
        targets = self.engines() if engines is None else engines
        calls = [engine_call(e, self.family, type(self).engine_half, step, *args, **kwargs) for e in targets]
        lost = getattr(self.owner, "member_lost", None) if self.tolerates_lost else None
        if lost is None:  # the first failure fails the step at once (a collective's others may wait for it)
            return list(await asyncio.gather(*calls))
        results = await asyncio.gather(*calls, return_exceptions=True)
        out = []
        for engine, result in zip(targets, results):
            if isinstance(result, ReplicaLost) and lost is not None:
                lost(engine, result)
                result = None
            elif isinstance(result, BaseException):
                raise result
            out.append(result)
        return out

    async def unwritten(self, *, version: int) -> dict[str, list[str]]:
        """Per replica that missed some: the parameters no load of this sync wrote."""
        results = await self.each("unwritten", version=version)
        return {f"replica {i}": names for i, names in enumerate(results) if names}
