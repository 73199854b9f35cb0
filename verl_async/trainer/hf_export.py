"""The plain HF folder (config, safetensors, tokenizer) that a rank's `export_hf` writes from full HF-named tensors."""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

import torch

HF_SUBDIR = "huggingface"  # verl's name of the HF folder inside a checkpoint's actor/ folder


def write_hf_folder(path: str, hf_config: Any, state: dict[str, torch.Tensor], dtype: torch.dtype,
                    settings: Any) -> str:
    """`save_pretrained` folder (config, safetensors, tokenizer) from full HF-named tensors."""
    from transformers import AutoModelForCausalLM

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
    save_tokenizer(path, settings)
    return path


def save_config_and_tokenizer(path: str, hf_config: Any, settings: Any) -> str:
    """The config and tokenizer (chat template included) of a checkpoint, without weights: what
    verl_async.model_merger needs besides the shards, so that it never depends on the original model folder."""
    os.makedirs(path, exist_ok=True)
    config = copy.deepcopy(hf_config)
    config.use_cache = True  # the trainer turns the KV cache off; a user of the folder generates
    config.save_pretrained(path)
    save_tokenizer(path, settings)
    return path


def save_tokenizer(path: str, settings: Any) -> None:
    """The run's tokenizer (with `custom_chat_template`) and the model's generation config, when it has one."""
    from verl_async.models.loading import load_tokenizer

    tok = load_tokenizer(settings.model_path, trust_remote_code=settings.trust_remote_code,
                         custom_chat_template=settings.custom_chat_template)
    tok.save_pretrained(path)
    source = os.path.join(os.path.expanduser(settings.model_path), "generation_config.json")
    target = os.path.join(path, "generation_config.json")
    if os.path.isfile(source) and os.path.abspath(source) != os.path.abspath(target):
        shutil.copyfile(source, target)
