"""Inference engines by name (`actor_rollout_ref.rollout.name`), so callers never branch on it.

Both engines are plain imports: `vllm_engine` does not import vLLM itself (starting a
VLLMEngine does, through `verl_async.optional`), so asking for "native" never needs vLLM.
An engine class takes its own keyword arguments (`build_engine`) and, for the Rollouter,
offers `from_config(rollout_cfg, *, model_path, device, trust_remote_code,
override_config, **overrides)` that reads the verl rollout keys (`build_engine_from_config`).
"""

from __future__ import annotations

from typing import Any, Mapping

from verl_async.rollout.engine import InferenceEngine
from verl_async.rollout.native import NativeEngine
from verl_async.rollout.vllm_engine import VLLMEngine

ENGINES: dict[str, type[InferenceEngine]] = {"native": NativeEngine, "vllm": VLLMEngine}


def engine_class(name: str) -> type[InferenceEngine]:
    if name not in ENGINES:
        raise ValueError(f"actor_rollout_ref.rollout.name: unknown engine {name!r}; available: {sorted(ENGINES)}")
    return ENGINES[name]


def build_engine(name: str, **kwargs: Any) -> InferenceEngine:
    """Construct engine `name` with its own keyword arguments."""
    return engine_class(name)(**kwargs)


def build_engine_from_config(rollout_cfg: Mapping[str, Any], **kwargs: Any) -> InferenceEngine:
    """Construct the engine `rollout_cfg.name` from the verl rollout config section."""
    cls = engine_class(str(rollout_cfg.get("name", "native")))
    return cls.from_config(rollout_cfg, **kwargs)
