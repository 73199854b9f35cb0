"""Checks of a request before the native engine admits it, and the answer it gets when refused (pure)."""

from __future__ import annotations

import numbers
from typing import Optional

from verl_async.rollout.engine import GenerateRequest, GenerateResult


def request_problem(request: GenerateRequest, vocab: int, max_model_len: int) -> Optional[str]:
    """Why the native engine cannot serve `request` (None: it can): checked before it takes a slot, so a bad
    request fails alone with a message instead of failing the step it would have joined."""
    sp = request.sampling
    try:
        sp.validate()
    except ValueError as exc:
        return str(exc)
    if not isinstance(sp.top_k, numbers.Integral) or sp.top_k < -1:
        return f"top_k must be -1/0 (off) or a positive int, got {sp.top_k!r}"
    if sp.seed is not None and not isinstance(sp.seed, numbers.Integral):
        return f"seed must be an int or None, got {sp.seed!r}"
    if not request.prompt_ids:
        return "prompt_ids is empty"
    for what, ids in (
        ("prompt_ids", request.prompt_ids),
        ("prefix_token_ids", request.prefix_token_ids),
        ("stop_token_ids", sp.stop_token_ids),
    ):
        bad = [t for t in ids if not isinstance(t, numbers.Integral) or not 0 <= t < vocab]
        if bad:
            return f"{what} holds ids outside the vocabulary [0, {vocab}): {bad[:5]}"
    n_prefix = len(request.prefix_token_ids)
    if not n_prefix == len(request.prefix_log_probs) == len(request.prefix_versions):
        return (
            f"prefix_token_ids ({n_prefix}), prefix_log_probs ({len(request.prefix_log_probs)}) and "
            f"prefix_versions ({len(request.prefix_versions)}) must have the same length"
        )
    context = len(request.prompt_ids) + n_prefix
    if context >= max_model_len:
        return (
            f"prompt ({len(request.prompt_ids)} tokens) + prefix ({n_prefix}) = {context} tokens leaves no room "
            f"in max_model_len={max_model_len}"
        )
    return None


def rejected(request: GenerateRequest, problem: str) -> GenerateResult:
    """The answer to a request the engine refused: its prefix back unchanged (a continuation loses nothing)."""
    return GenerateResult(
        request_id=request.request_id,
        token_ids=list(request.prefix_token_ids),
        log_probs=list(request.prefix_log_probs),
        versions=list(request.prefix_versions),
        finish_reason="abort",
        error=f"request {request.request_id!r}: {problem}",
    )
