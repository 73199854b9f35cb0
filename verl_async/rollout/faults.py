"""Fault injection for tests and drills: engine replicas that fail every request.

`VERL_ASYNC_FAIL_REPLICAS=0,2` (or `all`) wraps those replicas' engines so that every
generate returns an error, as a broken engine does (a wedged device, NaN logits, a bad
weight load), while weight syncs still succeed. CI runs `recipe.fully_async_main` with
it to check that such a run ends with a clear message (tests/test_fault_injection.py).
Unset (the default), nothing is wrapped.
"""

from __future__ import annotations

import os
from typing import Optional

from verl_async.rollout.engine import DelegatingEngine, GenerateRequest, GenerateResult, InferenceEngine

FAIL_ENV = "VERL_ASYNC_FAIL_REPLICAS"


def replica_fails(index: int, value: Optional[str] = None) -> bool:
    """Whether replica `index` is told to fail by VERL_ASYNC_FAIL_REPLICAS ("all" or a list of indices)."""
    value = os.environ.get(FAIL_ENV, "") if value is None else value
    names = {v.strip() for v in value.split(",") if v.strip()}
    return "all" in names or str(index) in names


class FailingEngine(DelegatingEngine):
    """`inner` with every generate answered by an error (the request is never run)."""

    def __init__(self, inner: InferenceEngine, message: str) -> None:
        super().__init__(inner)
        self.message = message

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return GenerateResult(request.request_id, list(request.prefix_token_ids), list(request.prefix_log_probs),
                              list(request.prefix_versions), "abort", error=self.message)


def with_faults(engine: InferenceEngine, index: int) -> InferenceEngine:
    """`engine`, or a FailingEngine around it when VERL_ASYNC_FAIL_REPLICAS names replica `index`."""
    if not replica_fails(index):
        return engine
    return FailingEngine(engine, f"injected failure on replica {index} ({FAIL_ENV}={os.environ[FAIL_ENV]})")
