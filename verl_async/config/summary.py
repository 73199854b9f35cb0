"""A short, human summary of a validated config, printed by the entry point at start."""

from __future__ import annotations

from typing import Any, Dict, Optional

from omegaconf import DictConfig

from verl_async.config import derived
from verl_async.config.run_paths import run_dir


# a verl script run as written sets no async_training key: it gets this recipe's fully async defaults
SYNC_HINT = ("schedule     fully async (no async_training.* key given); for verl's synchronous schedule add "
             "async_training.staleness_threshold=0 async_training.trigger_parameter_sync_step=1")


def _synchronous(at: Any) -> bool:
    return float(at.staleness_threshold) == 0 and int(at.trigger_parameter_sync_step) == 1


def _files(value: Any) -> str:
    return value if isinstance(value, str) else ", ".join(value or []) or "-"


def describe(cfg: DictConfig, facts: Optional[Dict[str, Any]] = None) -> str:
    arr, at, t = cfg.actor_rollout_ref, cfg.async_training, cfg.trainer
    facts = facts or {}
    rows, prompts = facts.get("rows", {}), facts.get("prompts", {})

    def data_line(split: str) -> str:
        n, kept = rows.get(split), prompts.get(split)
        if n is None:
            return _files(cfg.data[f"{split}_files"])
        used = "" if kept in (None, n) else f", {kept} used (skipped or filtered: {n - kept})"
        return _files(cfg.data[f"{split}_files"]) + f"  ({n} rows{used})"

    lines = [
        f"model        {arr.model.path}",
        f"data         train: {data_line('train')}",
        f"             val:   {data_line('val')}",
        f"trainer      {arr.actor.strategy} on {t.nnodes}x{t.n_gpus_per_node} {t.device}, "
        f"data-parallel {derived.trainer_dp_size(cfg)}",
        f"rollout      {arr.rollout.name} engine, {derived.rollout_replicas(cfg)} replica(s) "
        f"(tp {arr.rollout.tensor_model_parallel_size}), n={arr.rollout.n}, "
        f"max {cfg.data.max_prompt_length}+{cfg.data.max_response_length} tokens",
        f"algorithm    {cfg.algorithm.adv_estimator}, loss {arr.actor.loss_agg_mode}, "
        f"kl_loss {'on' if arr.actor.use_kl_loss else 'off'}, kl_in_reward {'on' if cfg.algorithm.use_kl_in_reward else 'off'}, "
        f"filter_groups {_filter_groups(cfg.algorithm.filter_groups)}",
        f"per step     {derived.required_samples(cfg)} groups ({derived.required_samples(cfg) * arr.rollout.n} responses); "
        f"sync every {at.trigger_parameter_sync_step} step(s) via {at.sync_transport}",
        f"staleness    threshold {at.staleness_threshold} -> at most {derived.max_required_samples(cfg)} groups "
        f"per parameter version; partial_rollout {'on' if at.partial_rollout else 'off'}",
        *([SYNC_HINT] if facts.get("async_keys_given") is False and not _synchronous(at) else []),
        f"outputs      {run_dir(cfg)}  (loggers: {', '.join(t.logger)}){_logger_dirs(t.logger)}",
    ]
    if facts.get("run_dir_moved"):
        lines.append(f"             {facts['run_dir_moved']}")
    threads = derived.cpu_threads(cfg)
    if threads is not None:
        ranks = t.cpu_threads_per_worker or threads
        lines.append(f"cpu threads  {ranks} per trainer rank, {threads} per engine replica "
                     f"(trainer.cpu_threads_per_worker; the cores shared by ranks and replicas)")
    if facts.get("resume") is not None:
        lines.append(f"checkpoint   {facts['resume'].describe()}")
    return "\n".join(lines)


def _logger_dirs(loggers: Any) -> str:
    """Where verl's environment variables move a logger's files (utils/tracking_backends.py)."""
    import os

    moved = [(name, var) for name, var in (("tensorboard", "TENSORBOARD_DIR"), ("file", "VERL_FILE_LOGGER_PATH"))
             if name in loggers and os.environ.get(var)]
    return "".join(f"; {name} in {os.path.abspath(os.path.expanduser(os.environ[var]))} (${var})"
                   for name, var in moved)


def _filter_groups(fg: Any) -> str:
    if not fg.enable:
        return "off"
    bound = f"{fg.max_num_gen_batches} gen batches" if fg.max_num_gen_batches else "unbounded"
    return f"on ({fg.metric}, {bound})"
