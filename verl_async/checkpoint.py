"""Checkpoint folder layout and rotation (verl's `global_step_{N}` layout).

    {default_local_dir}/global_step_{N}/actor/   what FSDPWorkerGroup.save(path) writes:
        dcp/                torch.distributed.checkpoint shards (model + optimizer)
        trainer_state.pt    lr scheduler, global step, skipped steps, the caller's `extra`
        rng_rank{r}.pt      RNG states per rank
        meta.json           written last by the ranks: marks the checkpoint complete (model_path, layout)
        run_info.json       what a resume must match (verl_async.config.resume.run_facts) and the step,
                            written by the driver before the folder is published
    {default_local_dir}/latest_checkpointed_iteration.txt   N of the newest complete one

The caller decides when to save (`trainer.save_freq`); these helpers name folders,
find the newest complete checkpoint and keep at most `max_actor_ckpt_to_keep`.

A checkpoint is written into `global_step_{N}.tmp/` and renamed into place once complete
(`staging_dir`, `publish`): the final save after the last sync may write the same step
again, and writing into the finished folder would leave its old meta.json next to half
of the new files after a crash. Publishing a step that is already on disk takes two
renames (the old folder to `.old`, the new one in); a kill between them leaves no
`global_step_{N}` at all. `latest_checkpoint` therefore also looks at those leftovers
(read-only), and `recover_interrupted_publish` finishes the publish before a resume.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Optional

COMPLETE_MARKER = "meta.json"
RUN_INFO = "run_info.json"
STAGING_SUFFIX = ".tmp"  # global_step_{N}.tmp: being written; never matched by _STEP_DIR
REPLACED_SUFFIX = ".old"  # global_step_{N}.old: the step's previous save, while publish() swaps it
LATEST_FILE = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_LEFTOVER_DIR = re.compile(r"^global_step_(\d+)(\.tmp|\.old)$")


def checkpoint_dir(root: str, step: int, role: str = "actor") -> str:
    return os.path.join(root, f"global_step_{int(step)}", role)


def step_folder(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{int(step)}")


def staging_dir(root: str, step: int, role: str = "actor") -> str:
    """An empty `role` folder to write step `step` into (what a save that died half-way left is removed)."""
    folder = step_folder(root, step) + STAGING_SUFFIX
    shutil.rmtree(folder, ignore_errors=True)
    return os.path.join(folder, role)


def publish(root: str, step: int) -> str:
    """Move the complete staging folder of `step` into place; an older folder of that step goes only then."""
    final = step_folder(root, step)
    staging = final + STAGING_SUFFIX
    if os.path.exists(final):
        old = final + REPLACED_SUFFIX
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)  # a kill right here leaves .old and .tmp: recover_interrupted_publish()
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
    return final


def write_run_info(path: str, info: dict[str, Any]) -> None:
    with open(os.path.join(path, RUN_INFO), "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)


def read_run_info(path: str) -> dict[str, Any]:
    """A checkpoint's run info merged over its completion marker (older checkpoints have the marker only)."""
    info: dict[str, Any] = {}
    for name in (COMPLETE_MARKER, RUN_INFO):
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file) as f:
                info.update(json.load(f))
    return info


def is_complete(path: str) -> bool:
    return os.path.exists(os.path.join(path, COMPLETE_MARKER))


def list_checkpoints(root: str, role: str = "actor") -> list[tuple[int, str]]:
    """(step, path) of complete checkpoints under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name, role)
        if m and is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def mark_latest(root: str, step: int) -> None:
    tmp = os.path.join(root, LATEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(int(step)))
    os.replace(tmp, os.path.join(root, LATEST_FILE))


def _complete_copy(root: str, step: int, role: str) -> Optional[str]:
    """The complete `role` folder of `step`: the published one, else what an interrupted publish left
    (its new, complete staging folder first, then the previous save it had moved aside)."""
    for suffix in ("", STAGING_SUFFIX, REPLACED_SUFFIX):
        path = os.path.join(step_folder(root, step) + suffix, role)
        if is_complete(path) and (suffix == "" or not os.path.exists(step_folder(root, step))):
            return path
    return None


def latest_checkpoint(root: str, role: str = "actor") -> Optional[str]:
    """The newest complete checkpoint (the tracker file first, else the highest step found).

    Read-only: a step whose publish was interrupted is found in its leftover folder (see
    `recover_interrupted_publish`, which moves it back into place).
    """
    tracker = os.path.join(root, LATEST_FILE)
    if os.path.exists(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        found = _complete_copy(root, int(text), role) if text.isdigit() else None
        if found is not None:
            return found
    if not os.path.isdir(root):
        return None
    steps = {int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(root)) if m}
    steps |= {int(m.group(1)) for m in map(_LEFTOVER_DIR.match, os.listdir(root)) if m}
    for step in sorted(steps, reverse=True):
        found = _complete_copy(root, step, role)
        if found is not None:
            return found
    return None


def recover_interrupted_publish(root: str, role: str = "actor") -> list[str]:
    """Finish what a kill inside `publish` or a save left: returns the renames done ("src -> dst").

    A step without its `global_step_{N}` folder gets back its newest complete leftover; leftovers
    of a step that is in place, and staging folders without their completion marker, are removed.
    Call it before resuming (never while a save may run).
    """
    if not os.path.isdir(root):
        return []
    done = []
    for step in sorted({int(m.group(1)) for m in map(_LEFTOVER_DIR.match, os.listdir(root)) if m}):
        final = step_folder(root, step)
        found = _complete_copy(root, step, role)
        if found is not None and not found.startswith(final + os.sep):
            source = os.path.dirname(found)
            os.replace(source, final)
            done.append(f"{source} -> {final}")
        for suffix in (STAGING_SUFFIX, REPLACED_SUFFIX):
            shutil.rmtree(final + suffix, ignore_errors=True)
    return done


def rotate_checkpoints(root: str, keep: Optional[int], role: str = "actor") -> list[str]:
    """Delete the oldest `global_step_*` folders beyond the newest `keep` (None or <= 0: keep all)."""
    if keep is None or keep <= 0:
        return []
    steps = list_checkpoints(root, role)
    removed = []
    for step, _ in steps[: max(0, len(steps) - keep)]:
        folder = os.path.join(root, f"global_step_{step}")
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
