"""OmegaConf resolvers used by the YAML (registered when verl_async.config is imported).

`${builtin_or:${actor_rollout_ref.model.path},A,B}` is A for a tiny built-in demo model
(builtin://tiny, builtin://tiny-random) and B otherwise (real models, builtin:// ones included). The CPU demo needs values (e.g. a learning rate of
3e-4 for a 0.6M-parameter model) that would wreck a real model; this keeps verl's
defaults for every real model path while the no-override demo still learns.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from verl_async.models.names import is_demo_model


def builtin_or(model_path: Any, demo_value: Any, default: Any) -> Any:
    return demo_value if is_demo_model(str(model_path)) else default


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("builtin_or"):
        OmegaConf.register_new_resolver("builtin_or", builtin_or)
