"""What a finished run did against what it was asked, in words: no run "succeeds" at nothing.

A run that trained 0 steps exits non-zero with one line saying why and what to change
(`zero_steps_error`); a run that trained fewer steps than it planned says so, and why, in its
last line (`shortfall`). The causes are the run's own counters: groups that
`algorithm.filter_groups` dropped, prompts that failed on every retry, groups that
`algorithm.max_staleness` dropped, and a data set too small for one more step. Pure: the
pipeline passes the counters in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RunCounts:
    """A run's ending, as the pipeline knows it."""

    trained: int  # steps this process trained
    step: int  # the trainer's step at the end (a resumed run counts from its checkpoint's step)
    planned: Optional[int]  # the step the run was to reach (None: unknown, e.g. debug.load_rollout_data)
    per_step: int  # groups one step takes (ppo_mini_batch_size x require_batches)
    queued: Optional[int] = None  # groups that reached the queue (None: no Rollouter)
    filtered: int = 0  # algorithm.filter_groups
    failed_prompts: int = 0  # failed on every retry (rollout.max_prompt_retries)
    dropped_stale: int = 0  # algorithm.max_staleness
    load_pattern: Optional[str] = None  # debug.load_rollout_data


def _causes(c: RunCounts) -> list[tuple[int, str, str]]:
    """(groups lost, what happened, what to change) for each cause, largest first."""
    out = []
    if c.filtered:
        out.append((c.filtered, f"algorithm.filter_groups dropped {c.filtered} group(s) whose responses all scored "
                                "the same",
                    "set algorithm.filter_groups.enable=false, or train on prompts where a group's responses differ "
                    "(a model that solves some but not all; a larger actor_rollout_ref.rollout.n or temperature)"))
    if c.failed_prompts:
        out.append((c.failed_prompts, f"{c.failed_prompts} prompt(s) failed on every retry "
                                      "(rollout/failed_prompts.jsonl)",
                    "fix the engine errors logged above (rollout/failed_prompts.jsonl has the last one per prompt)"))
    if c.dropped_stale:
        out.append((c.dropped_stale, f"algorithm.max_staleness dropped {c.dropped_stale} group(s)",
                    "raise algorithm.max_staleness (null: no cap) or lower async_training.staleness_threshold"))
    return sorted(out, key=lambda cause: -cause[0])


def _leftover(c: RunCounts) -> Optional[str]:
    """Groups that reached the trainer but did not fill one more step."""
    if c.queued is None:
        return None
    used = c.trained * c.per_step
    rest = c.queued - used - c.dropped_stale
    if 0 < rest < c.per_step:
        return f"{rest} group(s) were left over, fewer than the {c.per_step} one step takes"
    return None


def zero_steps_error(c: RunCounts) -> Optional[str]:
    """The one line a run that trained nothing fails with; None when it trained a step (or had nothing to do)."""
    if c.trained > 0 or (c.planned is not None and c.step >= c.planned):
        return None
    if c.load_pattern is not None and c.queued is None:
        return (f"trained 0 steps: debug.load_rollout_data={c.load_pattern} has no file for step {c.step} "
                "(rollout_id); point it at the files debug.save_rollout_data wrote")
    causes = _causes(c)
    if causes:
        what = "; ".join(text for _, text, _ in causes)
        if c.queued == 0 and c.filtered and not (c.failed_prompts or c.dropped_stale):
            what = (f"algorithm.filter_groups dropped every group generated ({c.filtered}): each group's responses "
                    "all scored the same")
        return f"trained 0 steps: {what}, so no batch of {c.per_step} groups formed; {causes[0][2]}"
    queued = "no group" if not c.queued else f"only {c.queued} group(s)"
    return (f"trained 0 steps: {queued} reached the trainer, and one step takes {c.per_step}; give the run more "
            "prompts (data.train_files, rollout.total_rollout_steps) or lower actor_rollout_ref.actor.ppo_mini_batch_size")


def shortfall(c: RunCounts) -> Optional[str]:
    """'k of N steps trained (why; what to change)' when the run ended before the step it planned, else None."""
    if c.planned is None or c.step >= c.planned or c.trained == 0:
        return None
    causes = _causes(c)
    why = [text for _, text, _ in causes]
    leftover = _leftover(c)
    if leftover:
        why.append(leftover)
    fix = causes[0][2] if causes else "give the run more prompts or lower actor_rollout_ref.actor.ppo_mini_batch_size"
    reason = "; ".join(why) if why else "the data ended early"
    return f"stopped at step {c.step} of {c.planned} planned: {reason}; {fix}"
