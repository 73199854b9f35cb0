"""A run folder holds one run: decided before anything is written, said in one line.

Every config names its folder after `trainer.experiment_name` (default `demo`), so the README's demo and
its multi-turn command both wrote to `outputs/verl_async/demo`: the second overwrote the first's
`config.yaml` and `trained_uids.jsonl` and appended to its logs and TensorBoard. A run that continues a
checkpoint in its folder (`config/resume.py`) writes there as before; any other run whose folder holds a
run's records gets the first free `<folder>-2`, `<folder>-3`, ... and the start-up summary says which.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from verl_async.config.errors import ConfigError
from verl_async.config.resume import ResumePlan, plan_resume

# what a run writes into its folder (docs/log_formats.md); checkpoints are global_step_N/
RECORDS = ("config.yaml", "metrics.jsonl", "trained_uids.jsonl", "timeline.jsonl", "timeline.html", "tensorboard",
           "rollout")
CHECKPOINT_PREFIX = "global_step_"


def records_in(folder: str) -> list[str]:
    """The run records `folder` holds (names, folders with a slash), in RECORDS order, checkpoints last."""
    if not os.path.isdir(folder):
        return []
    names = set(os.listdir(folder))
    found = [f"{n}/" if os.path.isdir(os.path.join(folder, n)) else n for n in RECORDS if n in names]
    if any(n.startswith(CHECKPOINT_PREFIX) for n in names):
        found.append(f"{CHECKPOINT_PREFIX}*/")
    return found


def _inside(path: str, folder: str) -> bool:
    folder = os.path.abspath(folder)
    return os.path.commonpath([os.path.abspath(path), folder]) == folder


def _continues(cfg: Any, folder: str, train_prompts: Optional[int]) -> Optional[ResumePlan]:
    """The plan that continues a checkpoint in `folder` (auto-resume), when this run may continue it."""
    from omegaconf import OmegaConf

    moved = OmegaConf.merge(cfg, {"trainer": {"default_local_dir": folder}})
    try:
        plan = plan_resume(moved, train_prompts)
    except ConfigError:  # another run's checkpoint (another model, n, data): not this run's folder
        return None
    return plan if plan.path is not None and _inside(plan.path, folder) else None


def claim(cfg: Any, plan: ResumePlan, train_prompts: Optional[int] = None) -> tuple[ResumePlan, Optional[str]]:
    """The plan with the folder this run writes to, and the line that says why it moved (None: it did not).

    Moves when the folder holds records and this run does not continue a checkpoint inside it (a fresh
    start, `trainer.resume_mode=disable`, or a checkpoint elsewhere named by trainer.resume_from_path):
    to the first `<folder>-k` (k = 2, 3, ...) holding a checkpoint this run continues (the same command,
    moved before: trainer.resume_mode=auto), else the first holding no records.
    """
    found = records_in(plan.root)
    if not found or (plan.path is not None and _inside(plan.path, plan.root)):
        return plan, None
    k, auto = 2, plan.mode == "auto" and plan.path is None
    while True:
        folder = f"{plan.root}-{k}"
        if not records_in(folder):
            moved = dataclasses.replace(plan, root=folder)
            break
        resumed = _continues(cfg, folder, train_prompts) if auto else None
        if resumed is not None:
            moved = resumed
            break
        k += 1
    why = "no checkpoint this run continues" if plan.path is None else f"this run continues {plan.path} instead"
    where = f"continues {moved.path}" if moved.path else f"writes to {moved.root}"
    return moved, (f"{plan.root} holds another run's records ({', '.join(found)}) and {why}: this run {where} "
                   "(set trainer.experiment_name or trainer.default_local_dir to choose)")
