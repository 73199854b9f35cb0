"""The teachers of a run, on the rollout side: replicas per teacher, routing by `teacher_key`, scores into responses.

Each replica (`TeacherReplica`, a Ray actor, or the plain class in-process) batches the requests that arrive
together (`MicroBatcher`) into one forward pass on its device, off its event loop. `TeacherPool.annotate`
is the Rollouter's response hook: as each response of a group finishes, the teacher its row routes to
scores it, while the engines keep generating the rest (generation never waits on a teacher; only the
group's put does). Weight syncs never reach a teacher: it is not among the engines a sync fans out to.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Callable, Mapping, Optional, Sequence

from verl_async.protocol import Response
from verl_async.teachers.model import TeacherModel, TeacherOutput, TeacherRequest
from verl_async.utils.replica_plan import ReplicaPlan
from verl_async.utils.microbatch import MicroBatcher

logger = logging.getLogger("verl_async.teachers")


class TeacherReplica:
    """One teacher model on one device, answering single requests in batches (the plain class behind the actor)."""

    def __init__(self, model_path: str, plan: ReplicaPlan, *, dtype: str = "float32", topk: Optional[int] = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 8192, trust_remote_code: bool = False) -> None:
        device = plan.enter()
        self.model = TeacherModel(model_path, device=str(device), dtype=plan.dtype(dtype), topk=topk,
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  trust_remote_code=trust_remote_code)
        self.batcher: MicroBatcher[TeacherRequest, TeacherOutput] = MicroBatcher(
            self.model.score, max_items=max_num_seqs, max_tokens=max_num_batched_tokens,
            cost=lambda r: len(r.token_ids))

    async def score(self, request: TeacherRequest) -> TeacherOutput:
        return await self.batcher.submit(request)

    def ready(self) -> bool:
        return True

    def stats(self) -> dict[str, float]:
        return {"batches": float(self.batcher.batches), "requests": float(self.batcher.items)}


def routing_value(item: Any, teacher_key: str) -> Any:
    """The row's `teacher_key` field: a PromptTask attribute (data_source) or an extra_info entry."""
    value = getattr(item, teacher_key, None)
    if value is None or value == "":
        value = (getattr(item, "extra_info", None) or {}).get(teacher_key)
    return value


class TeacherPool:
    """Replicas per teacher key; `annotate(item, response)` fills the response's teacher fields."""

    def __init__(self, replicas: Mapping[str, Sequence[Any]], route: Callable[[Any], str], teacher_key: str,
                 *, remote: bool) -> None:
        if not replicas or any(not r for r in replicas.values()):
            raise ValueError("TeacherPool needs at least one replica per teacher")
        self.replicas = {k: list(v) for k, v in replicas.items()}
        self._cycle = {k: itertools.cycle(range(len(v))) for k, v in self.replicas.items()}
        self.route, self.teacher_key, self.remote = route, teacher_key, remote
        self.scored = 0
        self.tokens = 0

    async def _score(self, key: str, request: TeacherRequest) -> TeacherOutput:
        replica = self.replicas[key][next(self._cycle[key])]
        if self.remote:
            return await replica.score.remote(request)
        return await replica.score(request)

    async def annotate(self, item: Any, response: Response) -> None:
        """Teacher log-probs (top-k too when the replica has k) of `response`'s tokens, stored on it."""
        if response.teacher_log_probs is not None:
            return
        key = self.route(routing_value(item, self.teacher_key))
        prompt = list(item.prompt_ids)
        out = await self._score(key, TeacherRequest(tuple(prompt + list(response.token_ids)), len(prompt)))
        response.teacher_log_probs = out.log_probs.tolist()
        if out.topk_ids is not None:
            response.teacher_topk_ids = out.topk_ids.tolist()
            response.teacher_topk_log_probs = out.topk_log_probs.tolist()
        self.scored += 1
        self.tokens += len(response)

    async def annotate_all(self, item: Any, responses: Sequence[Response]) -> None:
        """Every response still without teacher scores (a scheduling policy that did not pass the hook)."""
        await asyncio.gather(*(self.annotate(item, r) for r in responses))

    def metrics(self) -> dict[str, float]:
        return {"distillation/teacher_scored_responses": float(self.scored),
                "distillation/teacher_scored_tokens": float(self.tokens)}
