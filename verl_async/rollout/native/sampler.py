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

from verl_async.invariant.logprob import sampled_logprobs


class SamplingPlan:
    """The per-row settings of one batch, turned into tensors once (reused while the batch is unchanged).

    Building it does all the host work of a sampling step that depends only on the settings
    (which rows are greedy / seeded, the temperature, top-k and top-p tensors), so a decode
    step over an unchanged batch launches only the sampling kernels: no Python lists walked,
    no host->device copies.
    """

    __slots__ = (
        "rows", "vocab", "all_greedy", "greedy_mask", "temperatures", "use_k", "use_p", "max_k", "k_t", "p_t",
        "use_default", "seeded", "logprob_temperatures",
    )

    def __init__(
        self,
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        generators: Sequence[Optional[torch.Generator]],
        *,
        vocab: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,  # of the logits sampled from (float32 in the engine)
    ) -> None:
        rows = len(temperatures)
        if not (len(top_ks) == len(top_ps) == len(generators) == rows):
            raise ValueError(f"sample_tokens: per-row settings must all have {rows} entries")
        self.rows, self.vocab = rows, vocab
        greedy = [t == 0 for t in temperatures]
        temps = [t if t > 0 else 1.0 for t in temperatures]
        self.logprob_temperatures = temps
        self.all_greedy = all(greedy)
        self.greedy_mask = torch.tensor(greedy, device=device) if any(greedy) and not self.all_greedy else None
        self.temperatures = (
            None if all(t == 1.0 for t in temps) else torch.tensor(temps, device=device, dtype=dtype)[:, None]
        )
        ks = [k if 0 < k < vocab else vocab for k in top_ks]
        self.use_p = any(p < 1.0 for p in top_ps)
        self.use_k = not all(k == vocab for k in ks)
        self.max_k = max(ks) if ks else vocab
        self.k_t = torch.tensor(ks, device=device) if self.use_k or self.use_p else None
        self.p_t = torch.tensor(top_ps, device=device, dtype=dtype)[:, None] if self.use_p else None
        self.use_default = any(g is None and not gr for g, gr in zip(generators, greedy))
        self.seeded = [(row, g) for row, (g, gr) in enumerate(zip(generators, greedy)) if g is not None and not gr]


def filter_top_k_top_p(scaled: torch.Tensor, top_ks: Sequence[int], top_ps: Sequence[float]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf (rows of `scaled` are logits / T).

    top-k (k <= 0 or k >= V: off) is applied first; top-p then keeps the smallest set of the
    most likely remaining tokens whose probability (renormalised over the top-k set, as in HF
    and vLLM) reaches p. The most likely token is always kept.
    """
    rows = scaled.size(0)
    plan = SamplingPlan([1.0] * rows, top_ks, top_ps, [None] * rows, vocab=scaled.size(-1), device=scaled.device, dtype=scaled.dtype)
    return _filter(scaled, plan)


def _filter(scaled: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
    if not plan.use_p and not plan.use_k:
        return scaled
    vocab = scaled.size(-1)
    if not plan.use_p:  # top-k only: a partial sort is enough
        top_vals = scaled.topk(plan.max_k, dim=-1).values
        kth = top_vals.gather(-1, (plan.k_t - 1)[:, None])
        return scaled.masked_fill(scaled < kth, float("-inf"))  # ties with the k-th value are kept
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    keep = torch.arange(vocab, device=scaled.device)[None, :] < plan.k_t[:, None]
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= mass_before < plan.p_t
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
    if len(temperatures) != logits.size(0):
        raise ValueError(f"sample_tokens: per-row settings must all have {logits.size(0)} entries")
    plan = SamplingPlan(temperatures, top_ks, top_ps, generators, vocab=logits.size(-1), device=logits.device)
    return sample_with_plan(logits, plan, default_generator)


def sample_with_plan(
    logits: torch.Tensor, plan: SamplingPlan, default_generator: Optional[torch.Generator] = None,
    *, true_on_policy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` with the settings already in a SamplingPlan (same numbers, less host work).

    `true_on_policy`: the log-probs come from the trainer's own kernel (verl_async.invariant.logprob),
    bit for bit what it recomputes; the tokens are drawn the same way either way."""
    logits = logits.float()
    if logits.size(0) != plan.rows:
        raise ValueError(f"sample_tokens: the plan has {plan.rows} rows, the logits {logits.size(0)}")
    scaled = logits if plan.temperatures is None else logits / plan.temperatures
    if plan.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        allowed = _filter(scaled, plan)
        scores = torch.empty_like(allowed)
        if plan.use_default:
            scores.exponential_(generator=default_generator)
        for row, gen in plan.seeded:
            scores[row].exponential_(generator=gen)
        scores.clamp_(min=torch.finfo(scores.dtype).tiny).log_()  # Exp(1) may return exactly 0
        tokens = torch.sub(allowed, scores, out=scores).argmax(dim=-1)  # argmax(log p - log E)
        if plan.greedy_mask is not None:
            tokens = torch.where(plan.greedy_mask, logits.argmax(dim=-1), tokens)
    if true_on_policy:
        return tokens, sampled_logprobs(logits, tokens, plan.logprob_temperatures)
    # log_softmax(scaled)[token] without materialising the [B, V] log-softmax
    token_log_probs = scaled.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)
    return tokens, token_log_probs
