"""Model and tokenizer loading (HF id, local folder, GGUF file, builtin://) and the tiny demo model.

Attributes load lazily so that `verl_async.models.names` (used by config validation) does
not import torch.
"""

import importlib

_EXPORTS = {
    "apply_override_config": "verl_async.models.loading",
    "load_causal_lm": "verl_async.models.loading",
    "load_hf_config": "verl_async.models.loading",
    "load_tokenizer": "verl_async.models.loading",
    "build_char_tokenizer": "verl_async.models.tiny",
    "build_tiny_model_dir": "verl_async.models.tiny",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'verl_async.models' has no attribute {name!r}")
