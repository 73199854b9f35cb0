"""The sampled token's log-prob in true on-policy mode: one function for the engine and the trainer.

`log_softmax(logits.float() / T)[token]` through `algos.logprob`'s chunked kernel, so the engine's
few decode rows and the trainer's thousands of response positions get the same bits per row: on
CPU the softmax's denominator is an exact sum (exact.py; the max is exact, the rest elementwise),
on CUDA one Triton launch with a fixed reduction order over the vocab per row (`triton_softmax.token_logprobs`,
where `triton_ops.use_triton`), else every chunk has `Shapes.logprob_rows` rows (`fixed_chunks=True`, the last one
padded). The trainer's
training forward calls the same kernel with autograd (`token_logprobs_and_entropy`), its
no-grad forward `token_logprobs`: the PPO ratio of an unchanged policy is exactly 1.
"""

from __future__ import annotations

from typing import Sequence

import torch

from verl_async.algos.logprob import logprobs_and_entropy, logprobs_from_logits
from verl_async.invariant import exact, triton_ops, triton_softmax
from verl_async.invariant.shapes import shapes_for


def exact_row_sum(e: torch.Tensor) -> torch.Tensor:
    """[rows, V] -> [rows] in e's dtype: the exact sum of exact.sum_last, whatever the rows around it."""
    return exact.sum_last(e.to(torch.float64)).squeeze(-1).to(e.dtype)


def _kernel_args(device: torch.device) -> dict:
    if device.type == "cpu":
        return {"chunk_size": shapes_for(device).logprob_rows, "row_sum": exact_row_sum}
    return {"chunk_size": shapes_for(device).logprob_rows, "fixed_chunks": True}


def _triton(logits: torch.Tensor) -> bool:
    return logits.dtype in (torch.bfloat16, torch.float16, torch.float32) and triton_ops.use_triton(logits.device)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """[..., V] logits, [...] labels -> [...] float32 log-probs at `temperature` (0 or None: 1)."""
    if _triton(logits):
        return triton_softmax.token_logprobs(logits, labels, temperature)
    return logprobs_from_logits(logits, labels, temperature, **_kernel_args(logits.device))


def token_logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor,
                               temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and the entropy in one pass (the log-probs are the same bits)."""
    if _triton(logits):
        return triton_softmax.token_logprobs(logits, labels, temperature, with_entropy=True)
    return logprobs_and_entropy(logits, labels, temperature, **_kernel_args(logits.device))


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """The engine's call: rows may carry different temperatures (greedy rows report 1); each group of
    rows with one temperature goes through `token_logprobs` (a row's value does not depend on its group)."""
    temps = [t if t > 0 else 1.0 for t in temperatures]
    distinct = sorted(set(temps))
    if len(distinct) == 1:
        return token_logprobs(logits, tokens, distinct[0])
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for t in distinct:
        idx = torch.tensor([i for i, x in enumerate(temps) if x == t], device=logits.device)
        out[idx] = token_logprobs(logits.index_select(0, idx), tokens.index_select(0, idx), t)
    return out
