"""Checks against the machine, after validate(): the device exists, the data files read.

validate() looks at the config alone (fast, no torch); preflight() opens things, so
the entry point runs it once before starting Ray. Data files are resolved and
schema-checked with verl_async.data, the code the Rollouter loads them with. Problems
raise ConfigError naming the key that points at the bad thing.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from omegaconf import DictConfig, ListConfig

from verl_async.config import derived
from verl_async.config.errors import ConfigError
from verl_async.versions import check_transformers


def preflight(cfg: DictConfig) -> Dict[str, Any]:
    """Check transformers, device, model folder and data; return facts for the summary (rows per split).

    An unsupported transformers raises verl_async.versions.UnsupportedTransformersError (the entry
    point prints it in one line) before anything builds a model.
    """
    check_transformers()
    check_device(cfg)
    check_model_folder(cfg)
    check_loggers(cfg)
    rows = {split: count_rows(cfg, split) for split in ("train", "val")}
    train_rows = rows["train"]
    need = derived.required_samples(cfg)
    if train_rows is not None and train_rows < need:
        raise ConfigError(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"one trainer step needs {need} prompts (ppo_mini_batch_size * async_training.require_batches) "
            f"but data.train_files has only {train_rows} rows",
        )
    return {"rows": rows}


def check_device(cfg: DictConfig) -> None:
    """On a local run the driver's machine is the one that trains, so its device must exist."""
    if cfg.ray_init.address or os.environ.get("RAY_ADDRESS"):
        return  # joining a cluster: the workers' nodes hold the devices
    from verl_async.utils import device

    try:
        device.resolve(cfg.trainer.device)
    except device.DeviceUnavailableError as exc:
        raise ConfigError("trainer.device", str(exc).removeprefix(f"trainer.device={cfg.trainer.device} ")) from None


def check_model_folder(cfg: DictConfig) -> None:
    """A local model folder (validate() made sure it exists) must hold the HF config of a text-only model."""
    given = cfg.actor_rollout_ref.model.path
    path = os.path.expanduser(given)
    if not os.path.isdir(path):
        return
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError("actor_rollout_ref.model.path", f"{given} has no config.json (not an HF model folder)")
    try:
        with open(config_file, encoding="utf-8") as fh:
            hf_config = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError("actor_rollout_ref.model.path", f"{config_file} does not read as JSON: {exc}") from None
    if isinstance(hf_config, dict) and "vision_config" in hf_config:
        raise ConfigError("actor_rollout_ref.model.path", f"{given} is a vision-language model (config.json has "
                                                          "vision_config); VLM training is not implemented in "
                                                          "verl_async: use a text-only model")


def check_loggers(cfg: DictConfig) -> None:
    """Each trainer.logger backend's package is installed (the trainer would fail to start without it)."""
    from verl_async.utils.tracking import missing_packages

    missing = missing_packages(cfg.trainer.logger)
    if missing:
        raise ConfigError("trainer.logger", missing[0])


def count_rows(cfg: DictConfig, split: str) -> Optional[int]:
    """Rows in data.<split>_files, each file read and schema-checked by verl_async.data.

    builtin:// datasets are generated (and cached) here on first use. None when unset.
    """
    from verl_async.data import DataError, check_schema, read_table, resolve_data_files

    key, value = f"data.{split}_files", cfg.data[f"{split}_files"]
    if value is None or (isinstance(value, ListConfig) and len(value) == 0):
        return None
    total = 0
    try:
        for path in resolve_data_files(value, key):
            table = read_table(path, key)
            check_schema(table, path, cfg.data.prompt_key, cfg.data.reward_fn_key)
            total += table.num_rows
    except (DataError, FileNotFoundError, ValueError) as exc:
        raise ConfigError(key, str(exc).removeprefix(f"{key}: ")) from None
    return total
