"""Model and tokenizer loading (HF id or local path) and the tiny test/demo model."""

from verl_async.models.loading import apply_override_config, load_causal_lm, load_hf_config, load_tokenizer
from verl_async.models.tiny import build_char_tokenizer, build_tiny_model_dir

__all__ = [
    "apply_override_config",
    "build_char_tokenizer",
    "build_tiny_model_dir",
    "load_causal_lm",
    "load_hf_config",
    "load_tokenizer",
]
