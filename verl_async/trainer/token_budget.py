"""The token budget of a micro-batch when the config leaves it to the device (`ppo_max_token_len_per_gpu: null`).

Why: the budget is the trainer's main speed knob on an accelerator and a memory limit
everywhere. On an H100 (random Qwen2.5-0.5B shape, bench/RESULTS.md "FSDP2 training benchmark")
MFU went 13.4% -> 18.8% -> 23.7% from 8k to 16k to 32k tokens per micro-batch, with a 56 GB
peak at 32k; a CPU default of 4096 leaves most of that on the table, and one size cannot fit
a 135M and a 7B model alike.

How: after the model and optimizer are built, each rank reports the device memory still free
and the model's shape; the driver takes, over ranks,

    tokens = largest power of two <= FREE_SHARE * free_bytes / bytes_per_token

clamped to [MIN_TOKENS, MAX_TOKENS] and never below the longest sequence (a sequence cannot
be split across micro-batches). `bytes_per_token` counts the activations a training step
keeps per token: ACT_BYTES_PER_HIDDEN bytes per hidden unit per layer (bf16 activations of a
transformer layer with flash/SDPA attention, Korthikanti et al. 2022: 34 bytes x hidden) and
LOGIT_BYTES_PER_VOCAB bytes per vocabulary entry (the logits and their fp32 log-softmax).
Calibrated against the 56 GB peak above: 34 x 24 x 896 + 5 x 151936 = 1.49 MB per token, 32k
tokens = 49 GB of activations beside ~8 GB of model and optimizer state.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from verl_async.config.derived import CPU_TOKEN_BUDGET

CPU_TOKENS = CPU_TOKEN_BUDGET  # the CPU default: small machines, float32 (defined with the config: the preflight checks it)
MIN_TOKENS = 4096
MAX_TOKENS = 32768  # the largest size measured (bench/RESULTS.md); larger is unmeasured
FREE_SHARE = 0.7  # of the memory free after the model is built: the rest for fragmentation, NCCL, a colocated engine
ACT_BYTES_PER_HIDDEN = 34
LOGIT_BYTES_PER_VOCAB = 5
BUDGET_KEYS = ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu", "ref_log_prob_max_token_len_per_gpu")


def bytes_per_token(layers: int, hidden: int, vocab: int, *, gradient_checkpointing: bool = False) -> int:
    """Activation bytes a training step keeps per token (see the module docstring)."""
    per_layer = ACT_BYTES_PER_HIDDEN * hidden
    layer_bytes = per_layer * (1 if gradient_checkpointing else layers)  # checkpointing keeps ~one layer's
    return int(layer_bytes + LOGIT_BYTES_PER_VOCAB * vocab)


def fitting_tokens(free_bytes: float, per_token: int, longest_sequence: int = 0) -> int:
    """Largest power of two of tokens whose activations fit FREE_SHARE of `free_bytes`, clamped (docstring)."""
    if per_token <= 0:
        raise ValueError(f"bytes per token must be positive, got {per_token}")
    fits = int(FREE_SHARE * max(0.0, free_bytes) // per_token)
    tokens = MIN_TOKENS
    while tokens * 2 <= min(fits, MAX_TOKENS):
        tokens *= 2
    return max(tokens, int(longest_sequence))


def model_shape(hf_config: Any) -> dict[str, int]:
    """Layers, hidden size and vocabulary of an HF config (text models; multimodal ones nest it in text_config)."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    return {"layers": int(cfg.num_hidden_layers), "hidden": int(cfg.hidden_size), "vocab": int(cfg.vocab_size)}


def device_budget(reports: Sequence[Mapping[str, Any]], longest_sequence: int, *,
                  gradient_checkpointing: bool = False) -> tuple[int, str]:
    """The budget over every rank's report ({"free_bytes", "layers", "hidden", "vocab"}) and a line saying why."""
    per_token = bytes_per_token(reports[0]["layers"], reports[0]["hidden"], reports[0]["vocab"],
                                gradient_checkpointing=gradient_checkpointing)
    free = min(float(r["free_bytes"]) for r in reports)
    tokens = fitting_tokens(free, per_token, longest_sequence)
    why = (f"{tokens} tokens per micro-batch: {FREE_SHARE:.0%} of {free / 2**30:.1f} GiB free after the model was "
           f"built / {per_token / 2**20:.2f} MiB of activations per token, a power of two in "
           f"[{MIN_TOKENS}, {MAX_TOKENS}]" + (f", at least the longest sequence ({longest_sequence})"
                                               if tokens == longest_sequence and tokens > MIN_TOKENS else ""))
    return tokens, why


def unset_budgets(settings: Any) -> list[str]:
    """The budget keys the config left to the device (None in the settings)."""
    return [key for key in BUDGET_KEYS if getattr(settings, key) is None]


def free_device_bytes(device: str) -> Optional[int]:
    """Memory free on this process's accelerator now; None on CPU."""
    if device == "cpu":
        return None
    from verl_async.utils import device as device_layer

    mod = device_layer.accelerator_module(device)
    free, _total = mod.mem_get_info()
    return int(free)
