"""Tiny random models (Qwen2 by default; Qwen3, Llama, Mistral) with a locally built tokenizer: tests and the CPU demo.

Nothing here touches the hub. The tokenizer is byte-level (any UTF-8 text encodes;
each byte is one token, no merges) with Qwen's chat special tokens and a Qwen-style
chat template, so the same data and reward code paths run as for a real model.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# family -> (config class, model class) in transformers
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def build_char_tokenizer():
    """Byte-level tokenizer (256 byte tokens + 3 specials) wrapped as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    tok.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, END_OF_TEXT]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model_dir(
    out_dir: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: Optional[int] = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    overwrite: bool = False,
    family: str = "qwen2",
    **config_kwargs,
) -> str:
    """Write a random-weight model + tokenizer in `save_pretrained` layout; return the path.

    `family` is one of FAMILIES (the model families the README names: Qwen2, Qwen3, Llama,
    Mistral), so each can be tested small; `config_kwargs` go to its config (e.g.
    `sliding_window`). Idempotent: an existing folder with a config is reused unless `overwrite`.
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(FAMILIES)}")
    config_cls, model_cls = (getattr(transformers, name) for name in FAMILIES[family])
    if not overwrite and os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    tok = build_char_tokenizer()
    vocab_size = ((len(tok) + 7) // 8) * 8
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rope_theta=10000.0,
        torch_dtype="float32",
        **config_kwargs,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
