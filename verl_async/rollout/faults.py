"""Fault injection for tests and drills: engine replicas that fail every request.

`debug.fail_replicas=[0,2]` (or `all`) wraps those replicas' engines so that every
generate returns an error, as a broken engine does (a wedged device, NaN logits, a bad
weight load), while weight syncs still succeed. CI runs `recipe.fully_async_main` with
it to check that such a run ends with a clear message (tests/test_fault_injection.py).
Null (the default), nothing is wrapped.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from verl_async.rollout.engine import DelegatingEngine, GenerateRequest, GenerateResult, InferenceEngine

FailReplicas = Optional[Union[str, Sequence[int]]]  # debug.fail_replicas: null | "all" | replica indices


def replica_fails(index: int, fail_replicas: FailReplicas) -> bool:
    """Whether `fail_replicas` (debug.fail_replicas: null, "all" or a list of indices) names replica `index`."""
    if fail_replicas is None:
        return False
    if isinstance(fail_replicas, str):
        if fail_replicas != "all":
            raise ValueError(f"debug.fail_replicas: expected null, 'all' or a list of replica indices, "
                             f"got {fail_replicas!r}")
        return True
    return index in {int(i) for i in fail_replicas}


class FailingEngine(DelegatingEngine):
    """`inner` with every generate answered by an error (the request is never run)."""

    def __init__(self, inner: InferenceEngine, message: str) -> None:
        super().__init__(inner)
        self.message = message

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return GenerateResult(request.request_id, list(request.prefix_token_ids), list(request.prefix_log_probs),
                              list(request.prefix_versions), "abort", error=self.message)


def with_faults(engine: InferenceEngine, index: int, fail_replicas: FailReplicas) -> InferenceEngine:
    """`engine`, or a FailingEngine around it when `fail_replicas` names replica `index`."""
    if not replica_fails(index, fail_replicas):
        return engine
    shown = fail_replicas if isinstance(fail_replicas, str) else list(fail_replicas)
    return FailingEngine(engine, f"injected failure on replica {index} (debug.fail_replicas={shown})")
