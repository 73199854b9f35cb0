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
    """Base of every transport's rollout side: fans a step out to the replicas in `owner.sync_engines`."""

    family: str = ""
    engine_half: Callable[[Any], Any] = EngineHalf

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def engines(self) -> list:
        return list(self.owner.sync_engines)

    async def each(self, step: str, *args: Any, engines: Optional[list] = None, **kwargs: Any) -> list:
        """`step` on every replica at once; results in replica order."""
        return list(await asyncio.gather(*(engine_call(e, self.family, type(self).engine_half, step, *args, **kwargs)
                                           for e in (self.engines() if engines is None else engines))))

    async def unwritten(self, *, version: int) -> dict[str, list[str]]:
        """Per replica that missed some: the parameters no load of this sync wrote."""
        results = await self.each("unwritten", version=version)
        return {f"replica {i}": names for i, names in enumerate(results) if names}
