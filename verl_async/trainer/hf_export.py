"""The plain HF folder (config, safetensors, tokenizer) that a rank's `export_hf` writes from full HF-named tensors."""

from __future__ import annotations

import os
from typing import Any

import torch


def write_hf_folder(path: str, hf_config: Any, state: dict[str, torch.Tensor], dtype: torch.dtype,
                    settings: Any) -> str:
    """`save_pretrained` folder (config, safetensors, tokenizer) from full HF-named tensors."""
    from transformers import AutoModelForCausalLM

    from verl_async.models.loading import load_tokenizer

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=settings.trust_remote_code)
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(hf, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"export_hf: state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf.tie_weights()
    hf.config.use_cache = True
    os.makedirs(path, exist_ok=True)
    hf.save_pretrained(path)
    tok = load_tokenizer(settings.model_path, trust_remote_code=settings.trust_remote_code,
                         custom_chat_template=settings.custom_chat_template)
    tok.save_pretrained(path)
    return path
