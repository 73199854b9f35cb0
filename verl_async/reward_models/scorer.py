"""The Rollouter's group scorer with a reward model: the model's scores (and the rule rewards when asked), combined
and counted like a rule reward.

Each response's model score is one request to a replica (a classifier replica batches the requests that
arrive together; a judge's engine batches its generations), so the groups the Rollouter scores at once
share batches. A response the model cannot score (input too long, no number in a judge's answer, a replica
error) scores 0 from the model, is marked (`rm_error`) and counted in the reward manager's books: past
`reward_model.max_error_rate` of the last `error_window` responses the run stops with the model's error.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Awaitable, Callable, Optional, Sequence

from verl_async.protocol import Response
from verl_async.reward_models.scoring import (
    ModelScore,
    classifier_input,
    combine,
    judge_prompt,
    parse_judgement,
    response_text,
)

GroupScorer = Callable[[Any, list[Response]], Awaitable[list[tuple[float, dict]]]]


class RewardModelScorer:
    def __init__(self, spec: Any, kind: str, *, manager: Any, rule_scorer: Optional[GroupScorer],
                 policy_tokenizer: Any, rm_tokenizer: Any, replicas: Sequence[Any], remote: bool = True,
                 judge_request: Optional[Callable[[str, list[int]], Any]] = None) -> None:
        """`spec`: config/reward_model.RewardModelSpec; `replicas`: classifier replicas (discriminative) or judge
        engines (generative, with `judge_request(request_id, prompt_ids)` building their requests)."""
        if kind not in ("discriminative", "generative"):
            raise ValueError(f"reward model kind must be discriminative or generative, got {kind!r}")
        if not replicas:
            raise ValueError("RewardModelScorer needs at least one replica")
        self.spec, self.kind, self.manager, self.rule_scorer = spec, kind, manager, rule_scorer
        self.policy_tokenizer, self.rm_tokenizer = policy_tokenizer, rm_tokenizer
        self.replicas, self.remote, self.judge_request = list(replicas), remote, judge_request
        self._next = itertools.cycle(range(len(self.replicas)))
        self._serial = itertools.count()
        self.scored = self.failed = 0
        self.function = f"reward.reward_model.model_path={spec.model_path}"

    async def __call__(self, item: Any, responses: list[Response]) -> list[tuple[float, dict[str, float]]]:
        texts = [response_text(self.policy_tokenizer, r.token_ids) for r in responses]
        rule_task = self.rule_scorer(item, responses) if self.spec.use_task_rewards and self.rule_scorer else None
        model_scores = await asyncio.gather(*(self.score_one(item, text) for text in texts))
        rule = await rule_task if rule_task is not None else None
        out = []
        for i, (score, text) in enumerate(zip(model_scores, texts)):
            self.scored += 1
            self.failed += int(not score.ok)
            # raises RewardFunctionError when the model fails on too many of the last responses
            self.manager.count_model_score(score.error, item.data_source, text, item.ground_truth, self.function)
            out.append(combine(score, None if rule is None else rule[i], self.spec.reward_model_coef))
        return out

    async def score_one(self, item: Any, text: str) -> ModelScore:
        try:
            if self.kind == "discriminative":
                return await self._classify(item, text)
            return await self._judge(item, text)
        except Exception as exc:  # noqa: BLE001 - a replica error scores 0 and is counted, never raised alone
            return ModelScore(None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")

    def _replica(self) -> Any:
        return self.replicas[next(self._next)]

    def _too_long(self, ids: Sequence[int]) -> Optional[ModelScore]:
        if len(ids) > self.spec.max_input_tokens:
            return ModelScore(None, f"the reward model's input has {len(ids)} tokens, more than reward.reward_model."
                                    f"rollout.prompt_length={self.spec.max_input_tokens}")
        return None

    async def _classify(self, item: Any, text: str) -> ModelScore:
        ids = classifier_input(self.rm_tokenizer, item.messages or [], text)
        problem = self._too_long(ids)
        if problem is not None:
            return problem
        replica = self._replica()
        value = await (replica.score.remote(ids) if self.remote else replica.score(ids))
        return ModelScore(float(value))

    async def _judge(self, item: Any, text: str) -> ModelScore:
        chat = judge_prompt(self.spec.prompt_template, item.messages or [], text, item.ground_truth,
                            self.spec.min_score, self.spec.max_score)
        ids = list(self.rm_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False))
        problem = self._too_long(ids)
        if problem is not None:
            return problem
        request = self.judge_request(f"judge/{getattr(item, 'uid', '')}/{next(self._serial)}", ids)
        result = await self._replica().generate(request)
        if result.error is not None:
            return ModelScore(None, f"judge engine: {result.error}")
        answer = self.rm_tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return parse_judgement(answer, self.spec.score_pattern, self.spec.min_score, self.spec.max_score)

    def metrics(self) -> dict[str, float]:
        return {"reward/rm_scored": float(self.scored), "reward/rm_errors": float(self.failed)}
