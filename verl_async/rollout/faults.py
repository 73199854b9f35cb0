"""Fault injection for tests and drills: engine replicas that fail, die, hang or slow down.

`debug.fail_replicas` (null by default: nothing is wrapped) names replicas and what happens to
them; the grammar is in config/fault_specs.py:

    all | [0, 2]        every request of those replicas answers with an error, as a broken engine does
                        (a wedged device, NaN logits, a bad weight load), while weight syncs still succeed
    ["0:die@3"]         replica 0 kills its own process (SIGKILL, as `kill -9`) in the middle of its 3rd
                        request, in its first life only (the restarted replica serves: rollout/healing.py)
    ["0:crash@2"]       the same in every life (it ends retired after rollout.max_replica_restarts)
    ["1:hang@2"]        replica 1's 2nd request never answers, not even to an abort (first life only)
    ["1:slow=0.5"]      every request of replica 1 waits 0.5 s before it runs

CI runs `recipe.fully_async_main` with them (tests/test_fault_injection.py, tests/test_healing_drills.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Callable, Optional, Sequence

from verl_async.config.fault_specs import (  # noqa: F401 - the spec's names, importable from here too
    Fault,
    FailReplicas,
    FaultSpecError,
    parse_fail_replicas,
    replica_faults,
)
from verl_async.rollout.engine import DelegatingEngine, GenerateRequest, GenerateResult, InferenceEngine


def replica_fails(index: int, fail_replicas: FailReplicas) -> bool:
    """Whether debug.fail_replicas makes every request of replica `index` fail (kind `error`)."""
    return any(f.kind == "error" for f in replica_faults(index, fail_replicas))


def kill_this_process() -> None:
    """What `kill -9` of this process does (no cleanup, no exit handlers)."""
    os.kill(os.getpid(), signal.SIGKILL)


class FailingEngine(DelegatingEngine):
    """`inner` with every generate answered by an error (the request is never run)."""

    def __init__(self, inner: InferenceEngine, message: str) -> None:
        super().__init__(inner)
        self.message = message

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return GenerateResult(request.request_id, list(request.prefix_token_ids), list(request.prefix_log_probs),
                              list(request.prefix_versions), "abort", error=self.message)


class FaultyEngine(DelegatingEngine):
    """`inner` with the die / crash / hang / slow faults of one replica, counted per request of this life."""

    def __init__(self, inner: InferenceEngine, faults: Sequence[Fault],
                 kill: Optional[Callable[[], None]] = None) -> None:
        super().__init__(inner)
        self.faults = list(faults)
        self.requests = 0
        self._kill = kill or kill_this_process

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests += 1
        n = self.requests
        for fault in self.faults:
            if fault.kind == "slow" and n >= fault.at:
                await asyncio.sleep(fault.seconds)
            elif fault.kind == "hang" and n == fault.at:
                await asyncio.Event().wait()  # never set: no answer, not even to an abort
        dying = [f for f in self.faults if f.kind in ("die", "crash") and n == f.at]
        if not dying:
            return await self.inner.generate(request)
        running = asyncio.ensure_future(self.inner.generate(request))  # mid-generation: tokens are being made
        await asyncio.sleep(dying[0].seconds)
        self._kill()
        return await running  # reached only where `kill` does not end the process (tests)


def with_faults(engine: InferenceEngine, index: int, fail_replicas: FailReplicas, life: int = 0) -> InferenceEngine:
    """`engine`, wrapped by what debug.fail_replicas puts on replica `index` in this life (nothing: unchanged)."""
    faults = replica_faults(index, fail_replicas, life)
    if not faults:
        return engine
    others = [f for f in faults if f.kind != "error"]
    if others:
        engine = FaultyEngine(engine, others)
    if len(others) < len(faults):
        shown = fail_replicas if isinstance(fail_replicas, str) else list(fail_replicas or [])
        engine = FailingEngine(engine, f"injected failure on replica {index} (debug.fail_replicas={shown})")
    return engine
