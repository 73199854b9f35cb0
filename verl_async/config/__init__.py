"""Typed config for verl_async: schema, validation, verl-compatibility keys, Hydra helpers.

    from verl_async.config import ConfigError, validate
    cfg = validate(cfg)        # raises ConfigError("<full.key>: <reason>")

Importing this package does not import torch, Ray or Hydra (fast, for the entry point).
"""

from verl_async.config.cli import CONFIG_DIR, DEFAULT_CONFIG_NAME, MEGATRON_CONFIG_NAME, compose, hydra_argv
from verl_async.config.compat import COMPAT_KEYS, compat_keys_set, reset_compat_warnings
from verl_async.config.derived import (
    max_required_samples,
    required_samples,
    rollout_replicas,
    trainer_dp_size,
    trainer_world_size,
)
from verl_async.config.errors import ConfigError
from verl_async.config.resolvers import register_resolvers
from verl_async.config.validate import validate

register_resolvers()

__all__ = [
    "COMPAT_KEYS",
    "CONFIG_DIR",
    "ConfigError",
    "DEFAULT_CONFIG_NAME",
    "MEGATRON_CONFIG_NAME",
    "compat_keys_set",
    "compose",
    "hydra_argv",
    "max_required_samples",
    "required_samples",
    "reset_compat_warnings",
    "rollout_replicas",
    "trainer_dp_size",
    "trainer_world_size",
    "validate",
]
