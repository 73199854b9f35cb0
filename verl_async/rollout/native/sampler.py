"""Token sampling with per-row temperature, top-k, top-p, greedy and per-request seeds.

Pure tensor functions (no engine state), so the distribution test drives them directly.

Log-prob convention (binding, see verl_async.rollout.engine): the reported log-prob of the
sampled token is `log_softmax(logits.float() / T)[token]`; top-k / top-p only restrict what
may be drawn and are not renormalised into it; greedy rows (T == 0) report T = 1.

Sampling uses the exponential race: `argmax(log p_i - log E_i)` with `E_i ~ Exp(1)` draws
token i with probability `p_i / sum(p)`. It needs no softmax, treats every row in one
argmax, and lets each seeded request fill its own noise row from its own
`torch.Generator`, so a seeded request draws the same tokens whatever else is in the
batch (unseeded rows share the engine's generator).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def filter_top_k_top_p(scaled: torch.Tensor, top_ks: Sequence[int], top_ps: Sequence[float]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf (rows of `scaled` are logits / T).

    top-k (k <= 0 or k >= V: off) is applied first; top-p then keeps the smallest set of the
    most likely remaining tokens whose probability (renormalised over the top-k set, as in HF
    and vLLM) reaches p. The most likely token is always kept.
    """
    vocab = scaled.size(-1)
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    use_p = any(p < 1.0 for p in top_ps)
    if not use_p and all(k == vocab for k in ks):
        return scaled
    device = scaled.device
    k_t = torch.tensor(ks, device=device)
    if not use_p:  # top-k only: a partial sort is enough
        top_vals = scaled.topk(max(ks), dim=-1).values
        kth = top_vals.gather(-1, (k_t - 1)[:, None])
        return scaled.masked_fill(scaled < kth, float("-inf"))  # ties with the k-th value are kept
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    keep = torch.arange(vocab, device=device)[None, :] < k_t[:, None]
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= mass_before < torch.tensor(top_ps, device=device, dtype=probs.dtype)[:, None]
    keep_in_vocab_order = torch.empty_like(keep).scatter_(-1, order, keep)
    return scaled.masked_fill(~keep_in_vocab_order, float("-inf"))


def sample_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ks: Sequence[int],
    top_ps: Sequence[float],
    generators: Sequence[Optional[torch.Generator]],
    default_generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [B, V]; return (tokens [B] long, log-probs [B] float32).

    Per-row settings are plain Python sequences so deciding which work to do needs no
    device sync. Temperature 0 means greedy. NaN/Inf logits give a non-finite log-prob, which
    the caller checks on the host (no extra pass over the logits).
    """
    logits = logits.float()
    rows = logits.size(0)
    if not (len(temperatures) == len(top_ks) == len(top_ps) == len(generators) == rows):
        raise ValueError(f"sample_tokens: per-row settings must all have {rows} entries")
    greedy = [t == 0 for t in temperatures]
    temps = [t if t > 0 else 1.0 for t in temperatures]
    if all(t == 1.0 for t in temps):
        scaled = logits
    else:
        scaled = logits / torch.tensor(temps, device=logits.device, dtype=logits.dtype)[:, None]

    if all(greedy):
        tokens = logits.argmax(dim=-1)
    else:
        allowed = filter_top_k_top_p(scaled, top_ks, top_ps)
        scores = torch.empty_like(allowed)
        if any(g is None and not gr for g, gr in zip(generators, greedy)):
            scores.exponential_(generator=default_generator)
        for row, (gen, gr) in enumerate(zip(generators, greedy)):
            if gen is not None and not gr:
                scores[row].exponential_(generator=gen)
        scores.clamp_(min=torch.finfo(scores.dtype).tiny).log_()  # Exp(1) may return exactly 0
        tokens = torch.sub(allowed, scores, out=scores).argmax(dim=-1)  # argmax(log p - log E)
        if any(greedy):
            mask = torch.tensor(greedy, device=logits.device)
            tokens = torch.where(mask, logits.argmax(dim=-1), tokens)
    # log_softmax(scaled)[token] without materialising the [B, V] log-softmax
    token_log_probs = scaled.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)
    return tokens, token_log_probs
