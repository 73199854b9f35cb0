"""One checkpoint folder in, one HF folder out: check the folder, read the shards, write `save_pretrained`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from verl_async.model_merger.shards import ShardError, fsdp_state, megatron_state
from verl_async.checkpoint import COMPLETE_MARKER
from verl_async.trainer.common import DTYPES
from verl_async.trainer.hf_export import HF_SUBDIR, write_hf_folder

BACKENDS = ("fsdp", "megatron")


class MergeError(RuntimeError):
    """The folder cannot be merged as asked; the message says why and what to pass instead."""


@dataclass(frozen=True)
class HFSource:
    """Where the config and tokenizer come from (what `write_hf_folder` calls its settings)."""

    model_path: str
    trust_remote_code: bool = False
    custom_chat_template: Optional[str] = None  # already in the checkpoint's tokenizer


def read_meta(local_dir: str) -> dict[str, Any]:
    marker = os.path.join(local_dir, COMPLETE_MARKER)
    if not os.path.isdir(local_dir):
        raise MergeError(f"--local_dir {local_dir!r}: no such folder (expected .../global_step_N/actor)")
    if not os.path.exists(marker):
        raise MergeError(f"--local_dir {local_dir!r} is not a complete checkpoint (no {COMPLETE_MARKER}: a save that "
                         f"did not finish, or not the actor folder .../global_step_N/actor)")
    with open(marker) as f:
        return json.load(f)


def config_source(local_dir: str, meta: dict[str, Any], hf_model_path: Optional[str]) -> str:
    """actor/huggingface (written with every checkpoint), else --hf_model_path, else the model the run started from."""
    for path in (hf_model_path, os.path.join(local_dir, HF_SUBDIR), meta.get("model_path")):
        if path and os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
            return os.path.expanduser(path)
    raise MergeError(f"--local_dir {local_dir!r} has no {HF_SUBDIR}/config.json and the run's model "
                     f"{meta.get('model_path')!r} is not a local folder: pass --hf_model_path <HF folder of the model "
                     f"that was trained> (config and tokenizer)")


def merge(backend: str, local_dir: str, target_dir: str, *, dtype: Optional[str] = None,
          hf_model_path: Optional[str] = None, trust_remote_code: bool = False) -> str:
    """Write the checkpoint at `local_dir` as an HF folder at `target_dir`; returns `target_dir`."""
    from transformers import AutoConfig

    if backend not in BACKENDS:
        raise MergeError(f"--backend {backend!r}: one of {BACKENDS}")
    meta = read_meta(local_dir)
    written_by = meta.get("backend", "fsdp")
    if written_by != backend:
        raise MergeError(f"--local_dir {local_dir!r} was written by the {written_by} trainer: "
                         f"use --backend {written_by}")
    source = HFSource(config_source(local_dir, meta, hf_model_path), trust_remote_code=trust_remote_code)
    hf_config = AutoConfig.from_pretrained(source.model_path, trust_remote_code=trust_remote_code)
    try:
        state = fsdp_state(local_dir) if backend == "fsdp" else megatron_state(local_dir, meta, hf_config)
    except ShardError as exc:
        raise MergeError(str(exc)) from exc
    lora = meta.get("lora")
    if lora:  # a LoRA run: the shards hold peft's base weights and adapters; the HF folder gets them merged
        from verl_async.trainer.lora import merged_state

        state = merged_state(state, lora.get("scalings") or lora["alpha"] / lora["rank"])
    name = dtype or meta.get("hf_dtype")  # the training dtype; older checkpoints: the shards' own
    target = DTYPES[name] if name else next(iter(state.values())).dtype
    state = {key: t.to(target) for key, t in state.items()}
    try:
        return write_hf_folder(os.path.abspath(target_dir), hf_config, state, target, source)
    except RuntimeError as exc:  # a state dict that does not fit the config
        raise MergeError(f"the shards of {local_dir!r} do not fit the model config of {source.model_path!r}: {exc}") \
            from exc

