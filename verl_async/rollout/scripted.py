"""An engine wrapper that ends each response at a scripted length (benchmarks, tests).

Scheduling studies need controlled lengths: with a random tiny model a response ends
wherever EOS happens to be sampled. `TargetLengthEngine` wraps a real engine (run with
`ignore_eos`) and stops response `i` of prompt `uid` at `target(uid, i)` tokens, reporting
finish_reason "stop" there as if the model had emitted EOS. A request whose own
max_tokens is smaller (a P-DSR cap) still stops at its max_tokens with "length", so the
breaker and the continuation see exactly what they would see with a real long response.

It relies on the Rollouter's request ids, "<uid>/<i>/<serial>"; other ids pass through.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from verl_async.rollout.engine import DelegatingEngine, GenerateRequest, GenerateResult, InferenceEngine

TargetFn = Callable[[str, int], Optional[int]]


def parse_request_id(request_id: str) -> Optional[tuple[str, int]]:
    """(uid, response index) of a Rollouter request id, None for any other id."""
    parts = request_id.rsplit("/", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


class TargetLengthEngine(DelegatingEngine):
    """`inner` with each Rollouter response stopped at `target(uid, i)` tokens (None: untouched)."""

    def __init__(self, inner: InferenceEngine, target: TargetFn) -> None:
        super().__init__(inner)
        self.target = target

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        key = parse_request_id(request.request_id)
        goal = self.target(*key) if key is not None else None
        if goal is None:
            return await self.inner.generate(request)
        limit = request.sampling.max_tokens
        sampling = replace(request.sampling, max_tokens=max(1, min(limit, int(goal))))
        result = await self.inner.generate(replace(request, sampling=sampling))
        if result.finish_reason == "length" and len(result.token_ids) >= goal and goal < limit:
            result.finish_reason = "stop"
        return result
