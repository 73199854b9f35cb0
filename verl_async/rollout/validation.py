"""Validation: mean@k and pass@k of the reward function on `data.val_files`.

`Validator` generates `rollout.val_kwargs.n` samples of every validation prompt on the
engines it is given (the Rollouter's, between two training phases: the trainer asks for
it while generation is paused for a weight sync), scores them with the run's reward
manager and returns `val/*` metrics. `RolloutService.validate` is its one caller.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import zlib
from dataclasses import replace
from typing import Any, Optional, Sequence

import numpy as np

from verl_async.rollout.engine import GenerateRequest, InferenceEngine, SamplingParams
from verl_async.utils.timeline import Timeline

logger = logging.getLogger("verl_async.rollout")


class ValidationError(RuntimeError):
    """No validation response was generated: there is no accuracy to report."""


def validation_seed(seed: Optional[int], index: int, sample: int) -> Optional[int]:
    """One seed per validation sample: with one seed per prompt its k samples were identical (pass@k == mean@k)."""
    if seed is None:
        return None
    return zlib.crc32(f"{seed}/val/{index}/{sample}".encode()) & 0x7FFFFFFF


class Validator:
    """k samples per validation prompt, scored; see the module docstring."""

    def __init__(self, dataset: Any, reward: Any, sampling: SamplingParams, *, k: int, max_num_seqs: int,
                 timeline: Timeline) -> None:
        self.dataset = dataset
        self.reward = reward
        self.sampling = sampling
        self.k = int(k)
        self.max_num_seqs = int(max_num_seqs)
        self.timeline = timeline

    async def run(self, engines: Sequence[InferenceEngine], version: int) -> dict[str, float]:
        """mean@k and pass@k of the scorer, with rollout.val_kwargs sampling.

        Only responses that exist are scored: failed requests are counted
        (`val/failed_requests`), a prompt with none is left out, and a validation without
        any response raises (an accuracy of 0 would claim a model that answers wrong).
        """
        k, sampling = self.k, self.sampling
        sem = asyncio.Semaphore(self.max_num_seqs * len(engines))
        t0 = self.timeline.now()

        async def one(item, j: int):
            async with sem:
                engine = engines[(item.index * k + j) % len(engines)]
                seeded = replace(sampling, seed=validation_seed(sampling.seed, item.index, j))
                req = GenerateRequest(f"val-{version}-{item.index}-{j}", list(item.prompt_ids), seeded)
                return await engine.generate(req)

        items = list(self.dataset)
        results = await asyncio.gather(*(one(item, j) for item in items for j in range(k)))
        errors = [r.error for r in results if r.error is not None]
        if results and len(errors) == len(results):
            raise ValidationError(f"validation at version {version}: all {len(results)} generation requests failed "
                                  f"(first error: {errors[0]})")
        if errors:
            logger.warning("validation at version %d: %d of %d generation requests failed (first error: %s); "
                           "metrics cover the responses that exist", version, len(errors), len(results), errors[0])
        scores, accs, lengths = [], [], []
        by_source: dict[str, list[float]] = collections.defaultdict(list)
        for i, item in enumerate(items):
            group = [r for r in results[i * k : (i + 1) * k] if r.error is None]
            if not group:
                continue
            rewards = await asyncio.to_thread(
                self.reward.score_group, [r.token_ids for r in group], item.data_source, item.ground_truth, item.extra_info
            )
            s = [float(r.info.get("score", r.reward)) for r in rewards]
            a = [float(r.info.get("acc", float(r.reward > 0))) for r in rewards]
            scores.append(s)
            accs.append(a)
            lengths += [len(r.token_ids) for r in group]
            by_source[item.data_source].append(float(np.mean(a)))
        self.timeline.record("rollout/validation", "validate", t0, self.timeline.now(), version)
        out = {
            f"val/mean@{k}/score": float(np.mean(scores)),
            f"val/mean@{k}/acc": float(np.mean(accs)),
            f"val/pass@{k}/acc": float(np.mean([max(a) for a in accs])),
            "val/response_length/mean": float(np.mean(lengths)),
            "val/failed_requests": float(len(errors)),
        }
        for source, values in by_source.items():
            out[f"val/{source}/acc"] = float(np.mean(values))
        return out
