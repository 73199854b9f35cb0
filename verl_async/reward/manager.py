"""Reward managers: decode a group's responses, score them, shape the reward.

`naive` scores each response (verl's NaiveRewardManager). `dapo` adds DAPO's soft
overlong penalty (verl's DAPORewardManager):

    expected = max_resp_len - buffer_len
    penalty  = min(-(len - expected) / buffer_len * penalty_factor, 0)
    reward   = score + penalty

with `len` the response length in tokens (the EOS token included, as verl counts
`valid_response_length`). Configured by `reward_model.reward_kwargs.overlong_buffer_cfg.
{enable,len,penalty_factor,log}` and `reward_model.reward_kwargs.max_resp_len`.

Scoring never raises because of one response: a scorer that raises, returns garbage or a
non-finite value, or passes `reward_model.timeout_s` scores 0, is counted, logged
(rate-limited) and marked (`Reward.error`, `info["reward_error"]`, and no `acc`: a failed
score is no wrong answer, so accuracies leave it out). A function that fails on more than
`reward_model.max_error_rate` of the last `reward_model.error_window` responses is broken:
scoring raises `RewardFunctionError` and the run stops (error_rate.py). A configuration
error (unknown data_source, missing custom function) raises too.
The manager is plain and synchronous; an asyncio caller wraps `score_group` in
`asyncio.to_thread` (calls are serialised by the sandbox's lock).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from verl_async.reward.error_rate import ErrorWindow, too_many_failures
from verl_async.reward.registry import FunctionRef, custom_scorer_ref, resolve_scorer
from verl_async.reward.sandbox import Outcome, ScorerPool, Task, run_inline

logger = logging.getLogger(__name__)

REWARD_MANAGERS = ("naive", "dapo")
_DEFAULT_FN = FunctionRef(module="verl_async.reward.registry", name="default_compute_score")


class Reward(NamedTuple):
    reward: float
    info: dict[str, float]
    error: Optional[str] = None  # why the scorer failed (the response scored 0); None: it scored


@dataclass(frozen=True)
class OverlongBuffer:
    buffer_len: int
    penalty_factor: float
    max_resp_len: int
    log: bool = False

    def __post_init__(self) -> None:
        if self.buffer_len <= 0:
            raise ValueError(f"reward_model.reward_kwargs.overlong_buffer_cfg.len must be > 0, got {self.buffer_len}")
        if self.max_resp_len < self.buffer_len:
            raise ValueError(
                f"reward_model.reward_kwargs.max_resp_len ({self.max_resp_len}) must be >= "
                f"overlong_buffer_cfg.len ({self.buffer_len})"
            )

    def penalty(self, length: int) -> float:
        expected = self.max_resp_len - self.buffer_len
        return min(-(length - expected) / self.buffer_len * self.penalty_factor, 0.0)


@dataclass
class RewardStats:
    scored: int = 0
    errors: int = 0
    timeouts: int = 0


class RewardManager:
    def __init__(
        self,
        tokenizer: Any = None,
        *,
        name: str = "naive",
        custom_fn: Optional[FunctionRef] = None,
        custom_kwargs: Optional[Mapping[str, Any]] = None,
        overlong: Optional[OverlongBuffer] = None,
        timeout_s: float = 5.0,
        num_workers: int = 1,
        scorer_options: Optional[Mapping[str, Mapping[str, Any]]] = None,
        log_first: int = 10,
        log_every: int = 100,
        max_error_rate: float = 0.1,
        error_window: int = 200,
    ) -> None:
        if name not in REWARD_MANAGERS:
            raise ValueError(f"reward_model.reward_manager={name!r}: expected one of {REWARD_MANAGERS}")
        if not timeout_s > 0:
            raise ValueError(f"reward_model.timeout_s must be > 0, got {timeout_s}")
        self.name = name
        self.tokenizer = tokenizer
        self.custom_fn = custom_fn
        self.custom_kwargs = dict(custom_kwargs or {})
        self.overlong = overlong
        self.scorer_options = {name: dict(opts) for name, opts in (scorer_options or {}).items()}
        self.timeout_s = float(timeout_s)
        self.pool = ScorerPool(num_workers, preload=[custom_fn] if custom_fn is not None else [])
        self.stats = RewardStats()
        self.error_window = ErrorWindow(max_error_rate, error_window)
        self._stats_lock = threading.Lock()
        self._log_first, self._log_every = log_first, log_every

    # -- scoring ---------------------------------------------------------------------

    def _task(self, data_source: str, text: str, ground_truth: Any, extra_info: Optional[dict]) -> tuple[Task, bool, str]:
        """The scoring task, whether it runs inline (bounded), and the function's name for messages."""
        kwargs = dict(data_source=data_source, solution_str=text, ground_truth=ground_truth, extra_info=extra_info)
        if self.custom_fn is not None:
            return Task(self.custom_fn, {**kwargs, **self.custom_kwargs}), False, self.custom_fn.label
        spec = resolve_scorer(data_source)  # raises on an unknown data_source
        task = Task(_DEFAULT_FN, {**kwargs, **self.scorer_options.get(spec.name, {})})
        return task, spec.bounded, f"{_DEFAULT_FN.label} ({spec.name!r} scorer)"

    def score_texts(
        self,
        texts: Sequence[str],
        lengths: Sequence[int],
        data_source: str,
        ground_truth: Any,
        extra_info: Optional[dict] = None,
        extra_infos: Optional[Sequence[Optional[dict]]] = None,
    ) -> list[Reward]:
        """Rewards for decoded responses of one prompt; `lengths` are their token counts.

        `extra_infos`: one extra_info per response instead of the prompt's (multi-turn responses
        add their trajectory's num_turns, tool rewards, calc_reward scores).
        """
        if len(texts) != len(lengths):
            raise ValueError(f"score_texts: {len(texts)} texts but {len(lengths)} lengths")
        if extra_infos is not None and len(extra_infos) != len(texts):
            raise ValueError(f"score_texts: {len(texts)} texts but {len(extra_infos)} extra_infos")
        if not texts:
            return []
        task, bounded, function = self._task(data_source, texts[0], ground_truth, extra_info)
        infos = [{} if extra_infos is None else {"extra_info": e} for e in (extra_infos or texts)]
        tasks = [Task(task.fn, {**task.kwargs, "solution_str": t, **info}) for t, info in zip(texts, infos)]
        outcomes = [run_inline(t) for t in tasks] if bounded else self.pool.run(tasks, self.timeout_s)
        rewards = [self._shape(o, n) for o, n in zip(outcomes, lengths)]
        for outcome, text in zip(outcomes, texts):
            self._count(outcome, data_source, text, ground_truth, function)
        return rewards

    def score_group(
        self,
        response_ids: Sequence[Sequence[int]],
        data_source: str,
        ground_truth: Any,
        extra_info: Optional[dict] = None,
        extra_infos: Optional[Sequence[Optional[dict]]] = None,
    ) -> list[Reward]:
        """Rewards for token-id responses of one prompt (decoded without special tokens)."""
        if self.tokenizer is None:
            raise ValueError("RewardManager.score_group needs a tokenizer to decode responses")
        texts = self.tokenizer.batch_decode([list(r) for r in response_ids], skip_special_tokens=True)
        eos = getattr(self.tokenizer, "eos_token", None)
        if eos:  # verl's DAPO manager strips a literal EOS left in the text
            texts = [t[: -len(eos)] if t.endswith(eos) else t for t in texts]
        return self.score_texts(texts, [len(r) for r in response_ids], data_source, ground_truth, extra_info,
                                extra_infos)

    def score_sample(self, sample: Any) -> Any:
        """Fill `reward` / `reward_info` of every response of a RolloutSample in place."""
        rewards = self.score_group(
            [r.token_ids for r in sample.responses], sample.data_source, sample.ground_truth, sample.extra_info
        )
        for response, reward in zip(sample.responses, rewards):
            response.reward, response.reward_info = reward.reward, reward.info
        return sample

    def _shape(self, outcome: Outcome, length: int) -> Reward:
        if outcome.ok:
            info = dict(outcome.value)
            info.update(reward_error=0.0, reward_timeout=0.0)
        else:
            # no "acc": a failed score is not a wrong answer (critic/acc/mean and val/* leave it out)
            info = {"score": 0.0, "reward_error": 1.0, "reward_timeout": float(outcome.timed_out)}
        reward = info["score"]
        if self.overlong is not None:
            penalty = self.overlong.penalty(length)
            reward += penalty
            if self.overlong.log:
                info.update(overlong_reward=penalty, overlong=float(penalty < 0))
        return Reward(float(reward), info, None if outcome.ok else _error_text(outcome))

    def _count(self, outcome: Outcome, data_source: str, text: str, ground_truth: Any, function: str) -> None:
        """Count one scored response; raise RewardFunctionError when the function fails too often."""
        with self._stats_lock:
            self.stats.scored += 1
            broken = self.error_window.record(not outcome.ok)
            if outcome.ok:
                return
            self.stats.errors += 1
            self.stats.timeouts += int(outcome.timed_out)
            failures = self.stats.errors
            # built under the lock: the message reads the window
            stop = too_many_failures(self.error_window, function, _error_text(outcome), data_source, ground_truth,
                                     text) if broken else None
        if stop is not None:
            raise stop
        if failures <= self._log_first or failures % self._log_every == 0:
            logger.warning(
                "reward scorer %s for data_source=%r (scored 0; %d failures so far): %s; response[%d chars]=%r",
                "timed out" if outcome.timed_out else "failed", data_source, failures, outcome.error,
                len(text), text[:200],
            )

    def count_model_score(self, error: Optional[str], data_source: str, text: str, ground_truth: Any,
                          function: str) -> None:
        """Count a reward model's score of one response (`error`: why it failed) in the same books as a
        scorer's, so a failing model stops the run past reward_model.max_error_rate (verl_async/reward_models/)."""
        outcome = Outcome(value={"score": 0.0}) if error is None else Outcome(error=error)
        self._count(outcome, data_source, text, ground_truth, function)

    def summary(self) -> dict[str, int]:
        """Counts for the end-of-run summary: scored responses and those whose scorer failed (scored 0)."""
        with self._stats_lock:
            return {"reward_scored": self.stats.scored, "reward_errors": self.stats.errors}

    def metrics(self) -> dict[str, float]:
        with self._stats_lock:
            return {
                "reward/scored": float(self.stats.scored),
                "reward/scorer_errors": float(self.stats.errors),
                "reward/scorer_timeouts": float(self.stats.timeouts),
            }

    def close(self) -> None:
        self.pool.close()


def _error_text(outcome: Outcome) -> str:
    return f"{outcome.error} (reward_model.timeout_s)" if outcome.timed_out else str(outcome.error)


# -- construction from config -----------------------------------------------------------

def _plain(cfg: Any) -> dict:
    if cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    return dict(cfg)


def overlong_from_kwargs(reward_kwargs: Mapping[str, Any], max_response_length: Optional[int]) -> Optional[OverlongBuffer]:
    """`reward_model.reward_kwargs` -> OverlongBuffer, or None when the buffer is off."""
    buf = dict(reward_kwargs.get("overlong_buffer_cfg") or {})
    if not buf.get("enable", False):
        return None
    if buf.get("len") is None:
        raise ValueError("reward_model.reward_kwargs.overlong_buffer_cfg.len is required when the buffer is enabled")
    max_resp_len = reward_kwargs.get("max_resp_len", max_response_length)
    if max_resp_len is None:
        raise ValueError(
            "reward_model.reward_kwargs.max_resp_len is required when overlong_buffer_cfg.enable=True"
        )
    return OverlongBuffer(
        buffer_len=int(buf["len"]),
        penalty_factor=float(buf.get("penalty_factor", 1.0)),
        max_resp_len=int(max_resp_len),
        log=bool(buf.get("log", False)),
    )


CODE_DEADLINE_SHARE = 0.8  # of reward_model.timeout_s: code scoring stops its test cases by then


def code_scorer_options(sandbox_fusion: Any, timeout_s: float) -> dict[str, Any]:
    """The code scorer's settings (reward/code_score.py) from verl's `reward.sandbox_fusion.*`.

    `url` null: the built-in sandbox; else that SandboxFusion service, checked here (one line
    naming the key when nothing runs code there).
    """
    sf = _plain(sandbox_fusion)
    url = sf.get("url")
    if url:
        from verl_async.sandbox.client import service_problem

        problem = service_problem(str(url), "reward.sandbox_fusion.url")
        if problem:
            raise ValueError(problem)
    deadline = CODE_DEADLINE_SHARE * timeout_s
    return {"sandbox_fusion_url": str(url) if url else None, "memory_limit_mb": int(sf.get("memory_limit_mb", 1024)),
            "max_concurrent": int(sf.get("max_concurrent", 64)), "deadline_s": deadline,
            "case_timeout_s": min(10.0, deadline)}


def build_reward_manager(
    cfg_reward_model: Any,
    custom_reward_function_cfg: Any = None,
    tokenizer: Any = None,
    *,
    max_response_length: Optional[int] = None,
    sandbox_fusion: Any = None,
) -> RewardManager:
    """RewardManager from `reward_model.*` and `custom_reward_function.*` (DictConfig or dict).

    `max_response_length` (data.max_response_length) stands in for a missing
    `reward_kwargs.max_resp_len`; `sandbox_fusion` is verl's `reward.sandbox_fusion` (code rewards).
    """
    rm = _plain(cfg_reward_model)
    custom = _plain(custom_reward_function_cfg)
    name = rm.get("reward_manager", "naive")
    reward_kwargs = dict(rm.get("reward_kwargs") or {})
    overlong = overlong_from_kwargs(reward_kwargs, max_response_length)
    if overlong is not None and name != "dapo":
        raise ValueError(
            f"reward_model.reward_kwargs.overlong_buffer_cfg.enable=True needs reward_model.reward_manager=dapo "
            f"(got {name!r})"
        )
    return RewardManager(
        tokenizer,
        name=name,
        custom_fn=custom_scorer_ref(custom.get("path"), custom.get("name")),
        custom_kwargs=custom.get("reward_kwargs") or {},
        overlong=overlong,
        timeout_s=float(rm.get("timeout_s", 5.0)),
        num_workers=int(rm.get("num_workers", 1)),
        scorer_options={"gsm8k": {"method": str(rm.get("gsm8k_method", "strict"))},
                        "code": code_scorer_options(sandbox_fusion, float(rm.get("timeout_s", 5.0)))},
        max_error_rate=float(rm.get("max_error_rate", 0.1)),
        error_window=int(rm.get("error_window", 200)),
    )
