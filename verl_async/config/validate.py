"""validate(cfg): the one gate every run passes before anything starts.

Steps: resolve interpolations; merge into the typed schema (unknown keys and wrong
types fail here); no key may be left without a value; per-key rules from the schema
(choices, bounds); verl spellings mapped; cross-key checks (checks.py); one warning
per compatibility-only key that is set. The first problem found raises ConfigError,
whose text is one line naming the full key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, List, Mapping, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from verl_async.config import schema as S
from verl_async.config.checks import CHECKS
from verl_async.config.compat import ALIASES, unset, warn_compat_keys
from verl_async.config.errors import ConfigError
from verl_async.config.verl09 import map_verl09, refuse_unimplemented
from verl_async.config.verl_v1 import map_verl_v1, pre_merge as pre_merge_v1, used_keys as v1_used_keys

_MISSING = object()


def validate(cfg: Any) -> DictConfig:
    """Return a typed, resolved copy of `cfg` (a DictConfig or a plain dict).

    Values are converted to their declared types (e.g. "8" -> 8, 3 -> 3.0 for float
    keys), interpolations are resolved, and verl-derived values are filled in.
    Raises ConfigError on the first problem.
    """
    raw = _resolve(cfg)
    refuse_unimplemented(raw)
    pre_merge_v1(raw)
    strategy = _select(raw, "actor_rollout_ref.actor.strategy")
    _check_strategy_sections(raw, strategy)
    root = S.root_schema(strategy)
    _refuse_unknown_keys(root, raw)
    typed = _merge(OmegaConf.structured(root), raw, root)
    _check_missing(typed)
    _check_rules(typed, "")
    _normalize(typed)
    for check in CHECKS:
        check(typed)
    warn_compat_keys(typed, skip=v1_used_keys(typed))
    return typed


# --------------------------------------------------------------------------- steps
def _resolve(cfg: Any) -> dict:
    if not OmegaConf.is_config(cfg):
        cfg = OmegaConf.create(cfg)
    try:
        raw = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as exc:
        raise ConfigError(exc.full_key or "<config>", _first_line(exc)) from None
    if not isinstance(raw, dict):
        raise ConfigError("<config>", "the config must be a mapping of keys")
    raw.pop("hydra", None)
    return raw


def _check_strategy_sections(raw: dict, strategy: Any) -> None:
    """Megatron-only sections in a FSDP config (or the reverse) get a hint, not 'unknown key'."""
    if strategy == "megatron":
        for role in ("actor", "ref"):
            if _select(raw, f"actor_rollout_ref.{role}.megatron") is _MISSING:
                raise ConfigError(
                    f"actor_rollout_ref.{role}.megatron",
                    "missing: strategy=megatron needs --config-name=fully_async_ppo_megatron_trainer",
                )
        return
    for role in ("actor", "ref"):
        if _select(raw, f"actor_rollout_ref.{role}.megatron") is not _MISSING:
            raise ConfigError(
                f"actor_rollout_ref.{role}.megatron",
                f"used only with actor_rollout_ref.actor.strategy=megatron (got {strategy}); "
                "use --config-name=fully_async_ppo_megatron_trainer",
            )
    megatron_optim = {f.name for f in dataclasses.fields(S.MegatronOptimConfig)} - {
        f.name for f in dataclasses.fields(S.OptimConfig)
    }
    optim = _select(raw, "actor_rollout_ref.actor.optim")
    for name in sorted(megatron_optim & set(optim if isinstance(optim, dict) else ())):
        raise ConfigError(
            f"actor_rollout_ref.actor.optim.{name}",
            f"a Megatron optimizer key, but actor_rollout_ref.actor.strategy={strategy}; "
            "use --config-name=fully_async_ppo_megatron_trainer (FSDP uses optim.lr_scheduler_type)",
        )


def unknown_keys(cls: type, raw: Any, prefix: str = "") -> List[str]:
    """Every key of `raw` the schema `cls` does not declare (full keys, depth first); free-form nodes hold any."""
    if not isinstance(raw, dict) or not dataclasses.is_dataclass(cls):
        return []
    hints = typing.get_type_hints(cls)
    out: List[str] = []
    for name, value in raw.items():
        if name not in hints:
            out.append(f"{prefix}{name}")
            continue
        child = _dataclass_of(hints[name])
        if child is not None:
            out += unknown_keys(child, value, f"{prefix}{name}.")
    return out


def _refuse_unknown_keys(root: type, raw: dict) -> None:
    """All unknown keys in one line (a verl script sets several; one run per key would be a long way)."""
    unknown = unknown_keys(root, raw)
    if unknown:
        more = f"; also unknown: {', '.join(unknown[1:])}" if len(unknown) > 1 else ""
        raise ConfigError(unknown[0], "unknown key" + _suggest(root, unknown[0]) + more)


def _merge(schema: DictConfig, raw: dict, root: type) -> DictConfig:
    try:
        return OmegaConf.merge(schema, raw)
    except ConfigKeyError as exc:
        raise ConfigError(exc.full_key, "unknown key" + _suggest(root, exc.full_key)) from None
    except ValidationError as exc:
        key = exc.full_key
        value = _select(raw, key)
        expected = _expected_type(root, key)
        if expected:
            raise ConfigError(key, f"expected {expected}, got {value!r}") from None
        raise ConfigError(key, _first_line(exc)) from None
    except OmegaConfBaseException as exc:
        raise ConfigError(exc.full_key or "<config>", _first_line(exc)) from None


def _check_missing(typed: DictConfig) -> None:
    missing = sorted(OmegaConf.missing_keys(typed))
    if missing:
        raise ConfigError(missing[0], "has no value (every schema key needs one in config/*.yaml or an override)")


def _check_rules(node: DictConfig, prefix: str) -> None:
    """Apply the `rule(...)` metadata of the schema (schema_rules.py; choices, bounds), depth first in field order."""
    cls = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(cls):
        return
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        value = node[f.name]
        if isinstance(value, DictConfig):
            _check_rules(value, key + ".")
            continue
        if value is None or not f.metadata:
            continue
        values = list(value) if isinstance(value, (list, ListConfig)) else [value]
        for v in values:
            _check_value(key, v, f.metadata)


def _check_value(key: str, v: Any, rule: Mapping[str, Any]) -> None:
    choices = rule.get("choices")
    if choices is not None and v not in choices:
        raise ConfigError(key, f"unknown value {v!r}; expected one of: {', '.join(choices)}")
    bounds = (("ge", ">=", lambda a, b: a >= b), ("gt", ">", lambda a, b: a > b), ("le", "<=", lambda a, b: a <= b))
    for name, sign, ok in bounds:
        if name in rule and not ok(v, rule[name]):
            raise ConfigError(key, f"must be {sign} {rule[name]}, got {v}")


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _normalize(cfg: DictConfig) -> None:
    """Map verl spellings (compat.ALIASES, then verl 0.9's layout) and fill verl's implicit defaults."""
    for alias in ALIASES:
        value = _plain(OmegaConf.select(cfg, alias.src))
        if unset(value):
            continue
        current = _plain(OmegaConf.select(cfg, alias.dst))
        if current != alias.dst_default and current != value:
            raise ConfigError(alias.src, f"{value!r} conflicts with {alias.dst}={current!r}; set only one")
        OmegaConf.update(cfg, alias.dst, value, merge=False)
    map_verl09(cfg)
    map_verl_v1(cfg)  # before `auto` below: the V1 mode decides rollout.colocate
    actor = cfg.actor_rollout_ref.actor
    if actor.optim.warmup_style is not None:  # verl: the old name wins when set
        actor.optim.lr_scheduler_type = actor.optim.warmup_style
    for side in ("clip_ratio_low", "clip_ratio_high"):
        if actor[side] is None:
            actor[side] = actor.clip_ratio
    if cfg.async_training.trigger_parameter_sync_step is None:
        from verl_async.config.derived import auto_trigger_parameter_sync_step

        cfg.async_training.trigger_parameter_sync_step = auto_trigger_parameter_sync_step(cfg)
    if cfg.async_training.sync_transport == "auto":
        from verl_async.config.derived import auto_sync_transport

        cfg.async_training.sync_transport = auto_sync_transport(cfg)
    if isinstance(cfg.trainer.logger, str):
        cfg.trainer.logger = [cfg.trainer.logger]
    elif not isinstance(cfg.trainer.logger, (list, ListConfig)):
        raise ConfigError("trainer.logger", f"expected a list such as ['console','tensorboard'], got {cfg.trainer.logger!r}")


# --------------------------------------------------------------------------- messages
def _select(raw: Any, key: str) -> Any:
    node = raw
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return _MISSING
    return node


def _schema_field(root: type, key: str) -> Optional[tuple]:
    """(owning dataclass, field type) of a dotted key, or None (inside free-form nodes)."""
    cls: Any = root
    hint: Any = None
    for part in key.split("."):
        cls = _dataclass_of(hint) if hint is not None else cls
        if cls is None:
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        hint = hints[part]
    return cls, hint


def _dataclass_of(hint: Any) -> Any:
    for arg in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _expected_type(root: type, key: str) -> Optional[str]:
    found = _schema_field(root, key)
    if found is None:
        return None
    hint = found[1]
    optional = type(None) in typing.get_args(hint)
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) if optional else hint
    origin = typing.get_origin(base)
    if origin in (list, List):
        word = "a list"
    elif origin in (dict, typing.Dict) or dataclasses.is_dataclass(base):
        word = "a mapping of keys"
    else:
        word = _TYPE_WORDS.get(base)
    if word is None:
        return None
    return f"{word} or null" if optional else word


def _suggest(root: type, key: str) -> str:
    parent, _, name = key.rpartition(".")
    found = _schema_field(root, parent) if parent else (None, root)
    cls = _dataclass_of(found[1]) if found else None
    if cls is None:
        return ""
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""


def _first_line(exc: OmegaConfBaseException) -> str:
    msg = getattr(exc, "msg", None) or str(exc)
    return msg.strip().splitlines()[0]


__all__: List[str] = ["validate"]
