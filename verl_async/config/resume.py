"""Which checkpoint a run resumes, and whether it may: decided before anything is written.

Every config names its run folder after `trainer.experiment_name` (default `demo`) and
resumes automatically (`trainer.resume_mode=auto`), so a new job pointed at an old folder
would silently continue that run, or (another model) overwrite its config.yaml and then
fail to load the weights. `plan_resume` finds the checkpoint the trainer would load and
compares what it was made with (its meta.json and run_info.json, see
verl_async/checkpoint.py) with this run; a mismatch is a ConfigError naming both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from verl_async.config import derived
from verl_async.config.errors import ConfigError

_A = "actor_rollout_ref"


@dataclass(frozen=True)
class ResumePlan:
    mode: str  # trainer.resume_mode
    root: str  # trainer.default_local_dir
    path: Optional[str] = None  # the checkpoint to load; None: start fresh
    step: Optional[int] = None  # its trainer step (None: a checkpoint from before run_info.json)
    total_steps: Optional[int] = None  # of the whole run, this config's data and sizes
    fresh_because: Optional[str] = None  # why nothing is loaded, when not the mode or an empty folder
    finished: bool = False  # the checkpoint is the end of this run: nothing to train

    def nothing_to_do(self) -> str:
        """The one line a re-run of a finished run ends with (before Ray starts)."""
        return (f"nothing to train: {self.path} is the end of this run{step_of(self.step, self.total_steps)}. "
                "To train further raise rollout.total_epochs, rollout.total_rollout_steps or "
                "trainer.total_training_steps; to start a new run use another trainer.experiment_name "
                "(or trainer.default_local_dir)")

    def describe(self) -> str:
        """'resuming from <checkpoint> (step k of N)' or 'starting fresh (...)': what the user must know first."""
        if self.path is None:
            why = self.fresh_because or ("trainer.resume_mode=disable" if self.mode == "disable"
                                         else f"no checkpoint in {self.root}")
            return f"starting fresh ({why})"
        return f"resuming from {self.path}{step_of(self.step, self.total_steps)}"


def step_of(step: Optional[int], total: Optional[int]) -> str:
    if step is None:
        return ""
    return f" (step {step} of {total})" if total else f" (step {step})"


def total_steps(cfg: Any, train_prompts: int) -> int:
    """Trainer steps of the whole run: the prompts it generates (epochs x dataset, capped by
    rollout.total_rollout_steps) over the groups one step takes, capped by trainer.total_training_steps."""
    prompts = train_prompts * int(cfg.rollout.total_epochs)
    limit = cfg.rollout.get("total_rollout_steps")
    if limit is not None and int(limit) > 0:
        prompts = min(prompts, int(limit))
    steps = max(1, -(-prompts // derived.required_samples(cfg)))
    cap = cfg.trainer.get("total_training_steps")
    return min(steps, int(cap)) if cap else steps


def run_facts(cfg: Any, step: int, version: int, train_prompts: Optional[int], finished: bool = False) -> dict[str, Any]:
    """What the trainer writes beside a checkpoint (run_info.json); meta.json holds the model and layout.

    `finished`: the run ended at this checkpoint (its data or trainer.total_training_steps); with the keys
    that set where it ends (`ends_at`), a re-run of the same command then has nothing to train.
    """
    facts: dict[str, Any] = {"step": int(step), "version": int(version), "rollout_n": int(cfg.actor_rollout_ref.rollout.n)}
    if train_prompts is not None:
        facts["train_prompts"] = int(train_prompts)
    if finished:
        facts["finished"] = True
        facts["ends_at"] = ends_at(cfg)
    return facts


def ends_at(cfg: Any) -> dict[str, Any]:
    """The keys that decide where a run ends (a finished run continues when one of them grows)."""
    total = cfg.trainer.get("total_training_steps")
    limit = cfg.rollout.get("total_rollout_steps")
    return {"trainer.total_training_steps": None if total is None else int(total),
            "rollout.total_epochs": int(cfg.rollout.total_epochs),
            "rollout.total_rollout_steps": None if limit in (None, -1) else int(limit)}


def checkpoint_to_resume(trainer_cfg: Any) -> Optional[str]:
    """The checkpoint `trainer.resume_mode` names (read-only; the Trainer recovers torn publishes first)."""
    mode = str(trainer_cfg.resume_mode)
    if mode == "disable":
        return None
    if mode == "resume_path":
        return str(trainer_cfg.resume_from_path)
    if mode != "auto":  # a path given directly
        return mode
    from verl_async.checkpoint import latest_checkpoint

    return latest_checkpoint(str(trainer_cfg.default_local_dir))


def plan_resume(cfg: Any, train_prompts: Optional[int]) -> ResumePlan:
    """The checkpoint this run will resume, checked against it; ConfigError when the two differ."""
    t = cfg.trainer
    mode, root = str(t.resume_mode), str(t.default_local_dir)
    total = total_steps(cfg, train_prompts) if train_prompts else None
    if cfg.debug.get("rollout_only"):  # no trainer: nothing is loaded
        return ResumePlan(mode, root, total_steps=total, fresh_because="debug.rollout_only=true loads no checkpoint")
    if mode == "auto" and not os.path.isdir(root):
        return ResumePlan(mode, root, total_steps=total)
    path = checkpoint_to_resume(t)
    if path is None:
        return ResumePlan(mode, root, total_steps=total)
    from verl_async.checkpoint import read_run_info

    saved = read_run_info(path)
    now = resolved_model_path(str(cfg.actor_rollout_ref.model.path))
    problem = incompatibility(cfg, saved, now, train_prompts)
    if problem is not None:
        key, then, this = problem
        which = "trainer.resume_mode=auto would resume" if mode == "auto" else "to resume"
        raise ConfigError(key, f"the checkpoint {which}, {path}, {then}; this run {this}. {_ways_out(mode)}")
    if mode != "auto" and "model_path" in saved and not same_model(saved["model_path"], now):
        print(f"warning: {path} was trained from {saved['model_path']}; continuing it as {now} "
              f"(actor_rollout_ref.model.path)", flush=True)
    step = saved.get("step")
    finished = (bool(saved.get("finished")) and saved.get("ends_at") == ends_at(cfg)) or (
        step is not None and total is not None and int(step) >= total)
    return ResumePlan(mode, root, path, None if step is None else int(step), total, finished=finished)


def resolved_model_path(path: str) -> str:
    """The model folder the pipeline trains (and records in its checkpoints): builtin:// and *.gguf paths
    resolve to a cache folder (the demo models' is named without building them; a GGUF file is converted
    on first use), HF ids and folders stay as they are."""
    from verl_async.models.builtin import demo_model_folder, resolve_model_path
    from verl_async.models.names import is_demo_model

    try:
        return demo_model_folder(path) if is_demo_model(path) else resolve_model_path(path)
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(f"{_A}.model.path", str(exc).removeprefix(f"{_A}.model.path: ")) from None


def same_model(saved: str, now: str) -> bool:
    if saved == now:
        return True
    local = [os.path.expanduser(p) for p in (saved, now)]
    return all(os.path.exists(p) for p in local) and os.path.realpath(local[0]) == os.path.realpath(local[1])


def megatron_layout(cfg: Any) -> dict[str, Any]:
    """What a Megatron checkpoint's shards depend on (trainer/megatron/settings.py `layout`, from the config)."""
    mc = cfg.actor_rollout_ref.actor.megatron
    return {"tensor_model_parallel_size": int(mc.tensor_model_parallel_size),
            "pipeline_model_parallel_size": int(mc.pipeline_model_parallel_size),
            "data_parallel_size": derived.trainer_dp_size(cfg),
            "use_distributed_optimizer": bool(mc.use_distributed_optimizer)}


def incompatibility(cfg: Any, saved: Mapping[str, Any], model_path: str,
                    train_prompts: Optional[int]) -> Optional[tuple[str, str, str]]:
    """(key, what the checkpoint was made with, what this run has) for the first thing this run cannot
    continue from the checkpoint, or None.

    The model is compared only on auto-resume (a checkpoint named explicitly may continue under a
    moved or renamed model folder); the rest would fail to load or to continue in any mode.
    """
    arr = cfg.actor_rollout_ref
    if str(cfg.trainer.resume_mode) == "auto" and "model_path" in saved and not same_model(saved["model_path"], model_path):
        return f"{_A}.model.path", f"was trained from {saved['model_path']}", f"trains {model_path}"
    backend = "megatron" if arr.actor.strategy == "megatron" else "fsdp"
    if saved and saved.get("backend", "fsdp") != backend:
        return f"{_A}.actor.strategy", f"was written by {saved.get('backend', 'fsdp')}", f"uses {arr.actor.strategy}"
    if backend == "megatron" and saved.get("layout") is not None and saved["layout"] != megatron_layout(cfg):
        now = megatron_layout(cfg)
        key = next(k for k in now if saved["layout"].get(k) != now[k])
        where = "trainer.n_gpus_per_node" if key == "data_parallel_size" else f"{_A}.actor.megatron.{key}"
        return where, f"has the Megatron layout {saved['layout']}", f"has {now}"
    if "rollout_n" in saved and int(saved["rollout_n"]) != int(arr.rollout.n):
        return (f"{_A}.rollout.n", f"holds groups of {saved['rollout_n']} responses (queued and in flight)",
                f"samples {arr.rollout.n} per prompt")
    if train_prompts is not None and "train_prompts" in saved and int(saved["train_prompts"]) != train_prompts:
        return ("data.train_files", f"kept its data cursor over {saved['train_prompts']} training prompts",
                f"has {train_prompts} (the data files or their filtering changed)")
    return None


def _ways_out(mode: str) -> str:
    start_over = ("start over with trainer.resume_mode=disable (in a new folder beside it)"
                  if mode == "auto" else "start fresh with trainer.resume_mode=disable")
    return ("Resume it with the settings it was made with, start a new run with another trainer.experiment_name "
            f"(or trainer.default_local_dir), or {start_over}")


def resume_command(argv: list[str], resume_mode: str) -> str:
    """The command line that continues this run: the same arguments, with trainer.resume_mode=auto."""
    import shlex
    import shutil
    import sys

    args = [a for a in argv if a.lstrip("+").partition("=")[0] != "trainer.resume_mode"]
    if resume_mode != "auto":
        args.append("trainer.resume_mode=auto")
    on_path = shutil.which("python")
    python = "python" if on_path and os.path.realpath(on_path) == os.path.realpath(sys.executable) else sys.executable
    return shlex.join([python, "-m", "recipe.fully_async_main", *args])


def interrupted(cfg: Any, argv: list[str]) -> str:
    """The one line a Ctrl-C ends with: the newest checkpoint and the command that resumes from it."""
    from omegaconf import OmegaConf

    from verl_async.checkpoint import latest_checkpoint, read_run_info

    root = str(OmegaConf.select(cfg, "trainer.default_local_dir", default=None) or "")
    mode = str(OmegaConf.select(cfg, "trainer.resume_mode", default="auto"))
    save_freq = OmegaConf.select(cfg, "trainer.save_freq", default=None)
    save_freq = -1 if save_freq is None else int(save_freq)
    path = latest_checkpoint(root) if root else None
    if path is not None:
        where = f"{path}{step_of(read_run_info(path).get('step'), None)}"
        return f"interrupted; the newest checkpoint is {where}. Resume with: {resume_command(argv, mode)}"
    if save_freq <= 0:
        return (f"interrupted; nothing to resume: trainer.save_freq={save_freq} writes no checkpoint (add "
                "trainer.save_freq=N to checkpoint every N parameter versions). Start over with: "
                + resume_command(argv, "auto"))
    return (f"interrupted before the first checkpoint (trainer.save_freq={save_freq} versions); nothing to resume. "
            f"Start over with: {resume_command(argv, 'auto')}")
