"""Validation generations (`trainer.log_val_generations=N`, verl's choice and text format).

Validation picks N of its samples with `val_generations` and hands them back under
VAL_GENERATIONS_KEY; the trainer gives them to `Tracker.log_generations`, whose backends
render them with `format_val_generations`.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence

VAL_GENERATIONS_KEY = "val/generations"
VAL_GENERATIONS_SEED = 42  # verl's RandomState seed


def val_sample_order(inputs: Sequence[str], n: int) -> List[int]:
    """Indices of the `n` samples verl logs (RayPPOTrainer._maybe_log_val_generations).

    verl sorts the (input, output, score) samples by input text (a stable sort), shuffles
    them with numpy's RandomState(42) and keeps the first n; shuffling the sorted indices
    with the same generator permutes the same positions.
    """
    import numpy as np

    order = sorted(range(len(inputs)), key=inputs.__getitem__)
    np.random.RandomState(VAL_GENERATIONS_SEED).shuffle(order)
    return order[: max(0, int(n))]


def val_generations(tokenizer: Any, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                    scores: Sequence[float], n: int) -> List[dict]:
    """The `n` samples to log as plain dicts {input, output, score} (they cross Ray); texts without special tokens.

    One entry per scored response (a prompt with k samples is k entries), as in verl. Only
    the chosen responses are decoded.
    """
    if not (len(prompt_ids) == len(response_ids) == len(scores)):
        raise ValueError(f"val_generations: {len(prompt_ids)} prompts, {len(response_ids)} responses, "
                         f"{len(scores)} scores")
    inputs = tokenizer.batch_decode([list(p) for p in prompt_ids], skip_special_tokens=True)
    chosen = val_sample_order(inputs, n)
    outputs = tokenizer.batch_decode([list(response_ids[i]) for i in chosen], skip_special_tokens=True)
    return [{"input": inputs[i], "output": out, "score": float(scores[i])} for i, out in zip(chosen, outputs)]


def format_val_generations(samples: Sequence[Mapping[str, Any]], step: int, max_chars: Optional[int] = None) -> str:
    """verl's TensorBoard text of the samples (Markdown); `max_chars` shortens each text (the console)."""

    def cut(text: Any) -> str:
        text = str(text)
        if max_chars is None or len(text) <= max_chars:
            return text
        return f"{text[:max_chars]}... ({len(text) - max_chars} more characters)"

    parts = [f"**Generation Results - Step {step}**\n\n"]
    for i, s in enumerate(samples):
        parts.append(f"### Sample {i + 1}\n**Input:** {cut(s['input'])}\n\n**Output:** {cut(s['output'])}\n\n"
                     f"**Score:** {s['score']}\n\n---\n\n")
    return "".join(parts)
