"""Load tokenizers, configs and causal LMs the way verl users point at them.

`path` is an HF hub id or a local folder; nothing here downloads unless the hub is
reachable and the id is not a local folder. `trust_remote_code` is off unless the
user turns it on (docs/architecture.md "Safety defaults").
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch


def _resolve(path: str) -> str:
    expanded = os.path.expanduser(path)
    return expanded if os.path.exists(expanded) else path


def load_tokenizer(path: str, *, trust_remote_code: bool = False, custom_chat_template: Optional[str] = None):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(_resolve(path), trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise FileNotFoundError(
            f"cannot load tokenizer from actor_rollout_ref.model.path={path!r}: not a local folder and the hub "
            f"is not reachable or has no such id ({exc.__class__.__name__})"
        ) from exc
    if custom_chat_template:
        tok.chat_template = custom_chat_template
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    no_bpe_space_cleanup(tok)
    return tok


def no_bpe_space_cleanup(tok: Any) -> None:
    """A byte-level BPE tokenizer decodes without `clean_up_tokenization_spaces`.

    The cleanup is a WordPiece step that deletes real spaces before punctuation; transformers 5.x ignores it
    for BPE and warns on every process's first decode ("Ignoring clean_up_tokenization_spaces=True for BPE
    tokenizer"), 4.x applies it. Many BPE tokenizer files (Llama 3's, GGUF conversions) still set it: off
    here, every transformers decodes the same text and nothing warns. WordPiece tokenizers keep theirs.
    """
    model = getattr(getattr(tok, "backend_tokenizer", None), "model", None)
    if getattr(tok, "clean_up_tokenization_spaces", False) and type(model).__name__ == "BPE":
        tok.clean_up_tokenization_spaces = False


def run_tokenizer(model_cfg: Any, path: Optional[str] = None):
    """The run's tokenizer, as every side uses it (preflight, Rollouter, trainer, exports): the model's own, with
    `actor_rollout_ref.model.custom_chat_template` applied when set. `path`: the resolved model folder."""
    get = model_cfg.get
    return load_tokenizer(path or str(get("path")), trust_remote_code=bool(get("trust_remote_code", False)),
                          custom_chat_template=get("custom_chat_template"))


def apply_override_config(config: Any, override: Optional[Mapping[str, Any]]) -> Any:
    """Apply `actor_rollout_ref.model.override_config` to an HF config.

    verl accepts both flat keys (`override_config.attention_dropout=0`) and the Megatron
    style nested `override_config.model_config.max_position_embeddings=...`; both land
    on the HF config. An unknown attribute is an error naming it, not a silent no-op.
    """
    if not override:
        return config
    flat: dict[str, Any] = {}
    for key, value in dict(override).items():
        if key == "model_config" and isinstance(value, Mapping):
            flat.update(dict(value))
        else:
            flat[key] = value
    for key, value in flat.items():
        if not hasattr(config, key):
            raise ValueError(
                f"actor_rollout_ref.model.override_config: {type(config).__name__} has no attribute {key!r}"
            )
        setattr(config, key, value)
    return config


def load_hf_config(path: str, *, trust_remote_code: bool = False, override_config: Optional[Mapping[str, Any]] = None):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(_resolve(path), trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise FileNotFoundError(f"cannot load model config from actor_rollout_ref.model.path={path!r}: {exc}") from exc
    return apply_override_config(config, override_config)


def load_causal_lm(
    path: str,
    *,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    override_config: Optional[Mapping[str, Any]] = None,
    attn_implementation: Optional[str] = None,
    device: str | torch.device = "cpu",
    init_on_meta: bool = False,
):
    """The HF causal LM both trainer and native engine use (same class: smallest mismatch)."""
    from transformers import AutoModelForCausalLM

    config = load_hf_config(path, trust_remote_code=trust_remote_code, override_config=override_config)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if init_on_meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(_resolve(path), config=config, **kwargs)
    return model.to(device)
