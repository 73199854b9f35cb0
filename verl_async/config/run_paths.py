"""Every path an actor reads or writes, decided once on the driver.

On a Ray cluster an actor runs on another node, in a working directory of Ray's choosing:
a relative path given to it lands somewhere else (checkpoints under the node's own cwd, the
summary reading the driver's). `absolute_paths` therefore rewrites each path key to the
absolute path the driver means, before any actor sees the config; `shared_folders` names the
folders that several nodes must then see as one (the run's outputs, the verl_async cache when
the model or data come from it), which the run checks at start-up (utils/shared_dirs.py).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl_async.data.paths import resolve_data_files
from verl_async.utils.cache import cache_path

# Paths a run writes (they may not exist yet): always made absolute. Patterns keep their {fields}.
OUTPUT_KEYS = ("trainer.default_local_dir", "debug.save_rollout_data", "debug.save_train_output",
               "debug.load_rollout_data")
# Paths a run reads: made absolute when they exist here or look like paths (an HF id stays an id).
INPUT_KEYS = ("actor_rollout_ref.model.path", "data.tokenizer", "trainer.resume_from_path",
              "custom_reward_function.path", "actor_rollout_ref.rollout.multi_turn.tool_config_path",
              "actor_rollout_ref.rollout.multi_turn.function_tool_path")
DATA_KEYS = ("data.train_files", "data.val_files")

RUN_DIR_KEY = "trainer.default_local_dir"
CACHE_KEY = "VERL_ASYNC_CACHE"  # the environment variable that moves the cache (utils/cache.py)


def _absolute(path: str, cwd: str) -> str:
    return os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))


def _input_path(value: str, cwd: str) -> str:
    """A local path made absolute; `builtin://...`, other schemes and hub ids unchanged."""
    if "://" in value:
        return value
    full = _absolute(value, cwd)
    return full if value.startswith(("/", ".", "~")) or os.path.exists(full) else value


def run_dir(cfg: DictConfig) -> str:
    """The run's one output folder (trainer.default_local_dir), absolute as absolute_paths makes it."""
    return _absolute(str(cfg.trainer.default_local_dir), os.getcwd())


def absolute_paths(cfg: DictConfig, cwd: Optional[str] = None) -> DictConfig:
    """`cfg` with every path key absolute against `cwd` (default: the driver's), data files resolved
    to their parquet paths (builtin:// data is built here, once, not on each node)."""
    cwd = os.getcwd() if cwd is None else cwd
    updates: dict[str, Any] = {}
    for key in OUTPUT_KEYS:
        value = OmegaConf.select(cfg, key)
        if value:
            updates[key] = _absolute(str(value), cwd)
    for key in INPUT_KEYS:
        value = OmegaConf.select(cfg, key)
        if value:
            updates[key] = _input_path(str(value), cwd)
    for key in DATA_KEYS:
        value = OmegaConf.select(cfg, key)
        if value is not None and not (isinstance(value, (list, ListConfig)) and len(value) == 0):
            files = value if isinstance(value, (list, ListConfig)) else [value]
            updates[key] = [_absolute(p, cwd) for p in resolve_data_files(list(files), key)]
    out = OmegaConf.merge(cfg, OmegaConf.create({}))  # a copy; the caller's config stays as it was
    for key, value in updates.items():
        OmegaConf.update(out, key, value, merge=False)
    return out


def cache_root() -> str:
    """The verl_async cache as an absolute path ($VERL_ASYNC_CACHE, default ~/.cache/verl_async)."""
    return os.path.abspath(cache_path())


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), folder]) == folder


def shared_folders(cfg: DictConfig) -> dict[str, str]:
    """{name: folder} that every node of the run must see at the same path (`cfg` from absolute_paths).

    The run folder always (ranks write checkpoint shards the trainer renames; the Rollouter and the
    trainer both write logs there; the driver reads them back). The cache when the model, the tokenizer
    or the data were taken from it (builtin://, converted GGUF files): the driver built them there.
    """
    folders = {RUN_DIR_KEY: str(cfg.trainer.default_local_dir)}
    cache = cache_root()
    used = [OmegaConf.select(cfg, "actor_rollout_ref.model.path"), OmegaConf.select(cfg, "data.tokenizer")]
    for key in DATA_KEYS:
        files = OmegaConf.select(cfg, key)
        used.extend(files if isinstance(files, (list, ListConfig)) else [files])
    if any(isinstance(p, str) and os.path.isabs(p) and _inside(p, cache) for p in used):
        folders[CACHE_KEY] = cache
    return folders
