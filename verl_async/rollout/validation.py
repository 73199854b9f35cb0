"""Validation: mean@k and pass@k of the reward function on `data.val_files`.

`Validator` generates `rollout.val_kwargs.n` samples of every validation prompt on the
engines it is given (the Rollouter's: beside the training rollouts with
`trainer.val_async=true`, rollout/background_validation.py; while generation is paused for a
weight sync with `false`), scores them with the run's reward manager and returns `val/*`
metrics. `RolloutService.validate` is its one caller.

Metrics are over the samples that exist and scored: a failed or aborted request (an aborted
response is cut short: scoring it would count a truncated answer as wrong), or a response the
reward function failed on (`Reward.error`; never counted as a wrong answer), leaves its
prompt with fewer than k samples (`val/missing_samples`), each prompt counts with the
samples it has (`validation_metrics`). A validation that cannot report anything (every
request failed, or `trainer.val_timeout_s` passed) raises `ValidationError`; the Trainer
logs it and training goes on. A reward function that fails too often raises
`RewardFunctionError` (reward_model.max_error_rate), which stops the run as in training.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import zlib
from dataclasses import replace
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from verl_async.config.derived import VAL_TIMEOUT_RULE
from verl_async.rollout.agent_loop import reward_extra_info
from verl_async.rollout.agent_stats import AgentStats
from verl_async.rollout.engine import GenerateRequest, GenerateResult, InferenceEngine, SamplingParams
from verl_async.rollout.health import ReplicaLost
from verl_async.utils.busy_clock import BusyClock
from verl_async.utils.timeline import Timeline
from verl_async.utils.val_generations import VAL_GENERATIONS_KEY, val_generations

logger = logging.getLogger("verl_async.rollout")

ABORT_WAIT_S = 30.0  # a timed-out validation's requests are aborted; an engine that does not answer is left alone


class ValidationError(RuntimeError):
    """No validation response was generated: there is no accuracy to report."""


def validation_seed(seed: Optional[int], index: int, sample: int) -> Optional[int]:
    """One seed per validation sample: with one seed per prompt its k samples were identical (pass@k == mean@k)."""
    if seed is None:
        return None
    return zlib.crc32(f"{seed}/val/{index}/{sample}".encode()) & 0x7FFFFFFF


class ScoredPrompt(NamedTuple):
    """The samples one validation prompt has (1 to k of them): their scores and accuracies."""

    source: str
    scores: Sequence[float]
    accs: Sequence[float]


def validation_metrics(k: int, prompts: Sequence[ScoredPrompt], lengths: Sequence[int], *, requested: int,
                       failed: int, reward_errors: int = 0) -> dict[str, float]:
    """`val/*` over the samples that exist, per prompt (verl's mean@k / pass@k averaged over prompts).

    mean@k is the mean of each prompt's mean, pass@k the mean of each prompt's best
    accuracy, both over the samples that prompt has; prompts without any are left out.
    `requested` samples were asked for, `failed` requests failed, the reward function
    failed on `reward_errors` responses; the difference between `requested` and the
    samples scored is `val/missing_samples`. `lengths`: of every generated response.
    """
    if not prompts:
        raise ValidationError(f"no validation prompt has a scored sample ({failed} of {requested} requests failed, "
                              f"the reward function failed on {reward_errors})")
    by_source: dict[str, list[ScoredPrompt]] = collections.defaultdict(list)
    for p in prompts:
        by_source[p.source].append(p)
    out = {
        f"val/mean@{k}/score": float(np.mean([np.mean(p.scores) for p in prompts])),
        f"val/mean@{k}/acc": float(np.mean([np.mean(p.accs) for p in prompts])),
        f"val/pass@{k}/acc": float(np.mean([max(p.accs) for p in prompts])),
        "val/response_length/mean": float(np.mean(lengths)) if len(lengths) else 0.0,
        "val/failed_requests": float(failed),
        "val/reward_errors": float(reward_errors),
        "val/requested_samples": float(requested),
        "val/missing_samples": float(requested - sum(len(p.scores) for p in prompts)),
    }
    for source, group in by_source.items():
        acc = float(np.mean([np.mean(p.accs) for p in group]))
        out[f"val/{source}/acc"] = acc
        # verl's names (verl/trainer/ppo/metric_utils.py process_validation_metrics), beside ours
        out[f"val-core/{source}/acc/mean@{k}"] = acc
        out[f"val-core/{source}/acc/best@{k}/mean"] = float(np.mean([max(p.accs) for p in group]))
        out[f"val-aux/{source}/reward/mean@{k}"] = float(np.mean([np.mean(p.scores) for p in group]))
    return out


def failure(result: Any) -> Optional[str]:
    """Why a validation response does not count (None: it does): the engine's error, or an abort."""
    if result.error is not None:
        return result.error
    return "aborted" if result.finish_reason == "abort" else None


class _EngineBusyTimed:
    """An engine whose generate calls count on `clock`; tool calls between a trajectory's turns do not."""

    def __init__(self, engine: InferenceEngine, clock: BusyClock) -> None:
        self._engine, self._clock = engine, clock

    async def generate(self, request: GenerateRequest) -> Any:
        with self._clock.task():
            return await self._engine.generate(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class Validator:
    """k samples per validation prompt, scored; see the module docstring."""

    def __init__(self, dataset: Any, reward: Any, sampling: SamplingParams, *, k: int, max_num_seqs: int,
                 timeline: Timeline, timeout_s: float, log_generations: int = 0, agent_loop: Any = None,
                 engine_busy: Optional[BusyClock] = None) -> None:
        # the Rollouter's: validation keeps the engines busy too (rollout/idle_ratio)
        self.engine_busy = engine_busy if engine_busy is not None else BusyClock()
        self.agent_loop = agent_loop  # multi-turn: each sample is a whole trajectory (rollout/agent_loop.py)
        self.dataset = dataset
        self.reward = reward
        self.sampling = sampling
        self.k = int(k)
        self.max_num_seqs = int(max_num_seqs)
        self.timeline = timeline
        self.timeout_s = float(timeout_s)
        self.log_generations = int(log_generations)  # trainer.log_val_generations

    async def run(self, engines: Sequence[InferenceEngine], version: int) -> dict[str, Any]:
        """mean@k and pass@k of the scorer, with rollout.val_kwargs sampling, within `timeout_s`.

        With `log_generations` = N > 0 the dict also holds N scored samples under
        VAL_GENERATIONS_KEY (a list, not a metric: the trainer pops it for its tracker).

        Only responses that exist are scored: failed requests are counted
        (`val/failed_requests`, `val/missing_samples`), and a validation without any
        response raises (an accuracy of 0 would claim a model that answers wrong). On
        timeout the validation requests are aborted and ValidationError names the key.
        """
        try:
            return await asyncio.wait_for(self._run(engines, version), self.timeout_s)
        except asyncio.TimeoutError:
            await self.abort(engines, version)
            raise ValidationError(f"validation at version {version} did not finish within {self.timeout_s:g} s; "
                                  f"raise trainer.val_timeout_s ({VAL_TIMEOUT_RULE})") from None

    def _request_id(self, version: int, index: int, sample: int) -> str:
        return f"val-{version}-{index}-{sample}"

    async def abort(self, engines: Sequence[InferenceEngine], version: int) -> None:
        """Abort this version's validation requests on `engines` (timed out, or given up on by the trainer)."""
        ids = [self._request_id(version, item.index, j) for item in self.dataset for j in range(self.k)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.abort(ids) for e in engines), return_exceptions=True),
                                   ABORT_WAIT_S)
        except asyncio.TimeoutError:
            logger.warning("validation at version %d: aborting its requests took over %.0f s", version, ABORT_WAIT_S)

    async def _run(self, engines: Sequence[InferenceEngine], version: int) -> dict[str, Any]:
        k, sampling = self.k, self.sampling
        sem = asyncio.Semaphore(self.max_num_seqs * len(engines))
        t0 = self.timeline.now()
        agent_stats = AgentStats("val/multi_turn")

        timed = [_EngineBusyTimed(e, self.engine_busy) for e in engines]
        lost_replicas: set[int] = set()  # seen dead in this validation: their requests go to the others
        lost_error = ["every replica was lost"]  # the last loss seen (a missing sample's error)

        async def one(item, j: int):
            async with sem:
                first = (item.index * k + j) % len(engines)
                seeded = replace(sampling, seed=validation_seed(sampling.seed, item.index, j))
                req = GenerateRequest(self._request_id(version, item.index, j), list(item.prompt_ids), seeded)
                while True:
                    # round robin; a request whose replica died runs again on one still serving (the same weights:
                    # a sync waits for the validation), and is a missing sample only when none is left
                    alive = [i for i in range(len(engines)) if i not in lost_replicas]
                    if not alive:
                        return GenerateResult(req.request_id, [], [], [], "abort", error=lost_error[0])
                    at = first if first in alive else alive[(item.index * k + j) % len(alive)]
                    try:
                        if self.agent_loop is not None:
                            return await self.agent_loop.run_request(timed[at], req, item, agent_stats)
                        return await timed[at].generate(req)
                    except ReplicaLost as lost:
                        lost_replicas.add(at)
                        lost_error[0] = str(lost)

        items = list(self.dataset)
        results = await asyncio.gather(*(one(item, j) for item in items for j in range(k)))
        errors = [failure(r) for r in results if failure(r) is not None]
        if results and len(errors) == len(results):
            raise ValidationError(f"validation at version {version}: all {len(results)} generation requests failed "
                                  f"(first error: {errors[0]})")
        if errors:
            logger.warning("validation at version %d: %d of %d generation requests failed (first error: %s); "
                           "metrics cover the responses that exist", version, len(errors), len(results), errors[0])
        scored: list[ScoredPrompt] = []
        lengths: list[int] = []
        reward_errors: list[str] = []
        shown: list[tuple] = []  # (prompt ids, response ids, reward) of each scored response: log_generations
        for i, item in enumerate(items):
            group = [r for r in results[i * k : (i + 1) * k] if failure(r) is None]
            if not group:
                continue
            per_response = {"extra_infos": [reward_extra_info(item.extra_info, r) for r in group]} \
                if self.agent_loop is not None else {}  # multi-turn: each trajectory's num_turns, tool rewards ...
            rewards = await asyncio.to_thread(
                self.reward.score_group, [r.token_ids for r in group], item.data_source, item.ground_truth,
                item.extra_info, **per_response,
            )
            lengths += [len(r.token_ids) for r in group]
            reward_errors += [r.error for r in rewards if r.error is not None]
            ok = [r for r in rewards if r.error is None]  # a failed score is no answer, not a wrong one
            shown += [(item.prompt_ids, r.token_ids, w.reward) for r, w in zip(group, rewards) if w.error is None]
            if ok:
                scored.append(ScoredPrompt(item.data_source, [float(r.info.get("score", r.reward)) for r in ok],
                                           [float(r.info.get("acc", float(r.reward > 0))) for r in ok]))
        if reward_errors:
            logger.warning("validation at version %d: the reward function failed on %d of %d responses (first error: "
                           "%s); they are left out of val/*", version, len(reward_errors), len(lengths),
                           reward_errors[0])
        self.timeline.record("rollout/validation", "validate", t0, self.timeline.now(), version)
        out: dict[str, Any] = validation_metrics(k, scored, lengths, requested=len(results), failed=len(errors),
                                                 reward_errors=len(reward_errors))
        if self.log_generations > 0 and shown:
            out[VAL_GENERATIONS_KEY] = val_generations(self.reward.tokenizer, [p for p, _, _ in shown],
                                                       [r for _, r, _ in shown], [w for _, _, w in shown],
                                                       self.log_generations)
        if self.agent_loop is not None:
            out.update(agent_stats.metrics())
        return out
