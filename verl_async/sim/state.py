"""What the dispatch policies see of the running Simulation (pipeline.py): a group's state and the
calls a policy makes back. A Protocol here, so that dispatch.py need not import the simulation
that calls it (pipeline.py imports dispatch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

from verl_async.sim.replica import Job
from verl_async.sim.result import ResponseRecord
from verl_async.sim.workload import GroupSpec


@dataclass
class GroupState:
    gid: int
    spec: GroupSpec
    submit_time: float
    version_start: int
    responses: list[ResponseRecord | None] = field(default_factory=list)
    remaining: int = 0
    finish_time: float | None = None


class DispatchHost(Protocol):
    """The Simulation as a dispatch policy uses it: the groups in flight, making jobs, queueing them, finishing one."""

    groups: dict[int, GroupState]

    def make_job(self, gs: GroupState, response: int, kind: str, need: int, max_tokens: int,
                 prefix: int = 0, cap: Optional[int] = None, prev: Optional[Job] = None) -> Job: ...

    def push(self, pool: str, job: Job) -> None: ...

    def finish_response(self, job: Job) -> None: ...
