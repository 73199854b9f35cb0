"""Inference engines by name (`actor_rollout_ref.rollout.name`), so callers never branch on it.

Entries are import paths resolved on first use: asking for "native" never imports vLLM.
An engine class takes its own keyword arguments (`build_engine`) and, for the Rollouter,
offers `from_config(rollout_cfg, *, model_path, device, trust_remote_code,
override_config, **overrides)` that reads the verl rollout keys (`build_engine_from_config`).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Union

from verl_async.rollout.engine import InferenceEngine

EngineFactory = Union[str, Callable[..., InferenceEngine]]

_ENGINES: dict[str, EngineFactory] = {
    "native": "verl_async.rollout.native:NativeEngine",
    "vllm": "verl_async.rollout.vllm_engine:VLLMEngine",
}


def register_engine(name: str, factory: EngineFactory) -> None:
    """Add or replace an engine: a class/callable or an import path "package.module:Name"."""
    _ENGINES[name] = factory


def available_engines() -> list[str]:
    return sorted(_ENGINES)


def engine_class(name: str) -> Callable[..., InferenceEngine]:
    if name not in _ENGINES:
        raise ValueError(f"actor_rollout_ref.rollout.name: unknown engine {name!r}; available: {available_engines()}")
    factory = _ENGINES[name]
    if isinstance(factory, str):
        module_name, _, attr = factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except ImportError as exc:
            raise ImportError(f"actor_rollout_ref.rollout.name={name!r} needs {module_name} ({exc})") from exc
        _ENGINES[name] = factory
    return factory


def build_engine(name: str, **kwargs: Any) -> InferenceEngine:
    """Construct engine `name` with its own keyword arguments."""
    return engine_class(name)(**kwargs)


def build_engine_from_config(rollout_cfg: Mapping[str, Any], **kwargs: Any) -> InferenceEngine:
    """Construct the engine `rollout_cfg.name` from the verl rollout config section."""
    cls = engine_class(str(rollout_cfg.get("name", "native")))
    return cls.from_config(rollout_cfg, **kwargs)
