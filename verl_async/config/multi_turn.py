"""Checks of `actor_rollout_ref.rollout.multi_turn.*` (verl's multi-turn keys) that need more than one key or a file.

The tool files are loaded here, before anything starts, so a missing file, an unknown tool
class or a duplicate tool name stops the run with one line naming the key and the file
(the tool classes' modules are imported; tools are built only if they bring their own
schema instead of a `tool_schema`).
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

from verl_async.config.compat import warn_once
from verl_async.config.errors import ConfigError

KEY = "actor_rollout_ref.rollout.multi_turn"


def check_multi_turn(cfg: DictConfig) -> None:
    """Also makes the tool file paths absolute (checks may fill values, checks.py)."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        for name in ("tool_config_path", "function_tool_path"):
            if mt[name]:
                warn_once(f"{KEY}.{name}", f"{KEY}.{name} is set but {KEY}.enable=false: no tools are used")
        return
    if cfg.async_training.long_tail.enable:
        raise ConfigError("async_training.long_tail.enable",
                          f"P-DSR long-tail scheduling works on single responses, not with {KEY}.enable=true; "
                          "set async_training.long_tail.enable=false")
    if not (mt.tool_config_path or mt.function_tool_path):
        warn_once(f"{KEY}.tool_config_path", f"{KEY}.enable=true without tool_config_path or function_tool_path: "
                                             "responses are single turns")
        return
    from verl_async.tools.tool_registry import ToolLoadError, tool_names

    for name in ("tool_config_path", "function_tool_path"):  # the rollout actor's working folder may differ
        if mt[name]:
            mt[name] = os.path.abspath(os.path.expanduser(mt[name]))
    try:
        tool_names(mt.tool_config_path, mt.function_tool_path)
    except ToolLoadError as err:
        raise ConfigError(f"{KEY}.{err.key}", err.reason) from None
