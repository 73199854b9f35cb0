"""The sampler draws from the intended (temperature / top-k / top-p filtered) distribution."""

from __future__ import annotations

import math

import pytest
import torch

from verl_async.rollout.native.sampler import filter_top_k_top_p, sample_tokens

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.7, 0.3, 0.0, -0.4, -1.0, -2.0, -3.0])


def intended_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Reference in float64, written independently of the sampler: HF/vLLM order T -> top-k -> top-p."""
    x = logits.double() / temperature
    order = torch.argsort(x, descending=True).tolist()
    keep = order[:top_k] if top_k > 0 else order
    p = torch.softmax(x[keep], dim=0)
    kept, mass = [], 0.0
    for idx, prob in zip(keep, p.tolist()):
        if mass >= top_p:
            break
        kept.append(idx)
        mass += prob
    out = torch.zeros_like(x)
    out[kept] = torch.softmax(x[kept], dim=0)
    return out


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    n = counts.sum().item()
    expected = probs[support] * n
    stat = (((counts[support].double() - expected) ** 2) / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def draw(n: int, temperature: float, top_k: int, top_p: float, *, seeded: bool) -> torch.Tensor:
    logits = LOGITS.repeat(n, 1)
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(n)] if seeded else [None] * n
    tokens, _ = sample_tokens(logits, [temperature] * n, [top_k] * n, [top_p] * n, gens, torch.Generator().manual_seed(0))
    return torch.bincount(tokens, minlength=LOGITS.numel())


@pytest.mark.parametrize(
    "temperature,top_k,top_p,seeded",
    [(1.0, -1, 1.0, False), (0.7, -1, 1.0, False), (1.3, 4, 1.0, False), (0.8, -1, 0.75, False), (1.0, 6, 0.8, True)],
)
def test_sampler_matches_intended_distribution(temperature, top_k, top_p, seeded):
    n = 4000 if seeded else 20000
    counts = draw(n, temperature, top_k, top_p, seeded=seeded)
    probs = intended_probs(LOGITS, temperature, top_k, top_p)
    assert counts[probs == 0].sum() == 0, "drew a token outside the top-k/top-p set"
    assert chi_square_p_value(counts, probs) > 1e-3
    if top_k > 0 or top_p < 1:  # the test has power: the unfiltered distribution is rejected
        assert chi_square_p_value(counts, intended_probs(LOGITS, temperature, -1, 1.0)) < 1e-6


def test_log_prob_convention_and_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    temps, ks, ps = [0.0, 0.6, 1.0, 1.7], [-1, 5, 3, -1], [1.0, 0.5, 1.0, 0.9]
    tokens, lps = sample_tokens(logits, temps, ks, ps, [None] * 4, torch.Generator().manual_seed(1))
    assert tokens[0] == logits[0].argmax()
    for row, t in enumerate(temps):
        ref = torch.log_softmax(logits[row] / (t if t > 0 else 1.0), dim=-1)[tokens[row]]
        assert abs(lps[row].item() - ref.item()) < 1e-6  # not renormalised over the top-k / top-p set
    # top-k rows stay inside their top-k
    assert tokens[2].item() in logits[2].topk(3).indices.tolist()


def test_seeded_rows_do_not_depend_on_batch():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(5))

    def run(rows):
        gens = [torch.Generator().manual_seed(42) if r == 2 else None for r in rows]
        toks, _ = sample_tokens(logits[rows], [1.0] * len(rows), [-1] * len(rows), [1.0] * len(rows), gens, None)
        return toks[rows.index(2)].item()

    alone = [run([2]) for _ in range(3)]
    mixed = run([0, 1, 2, 3, 4, 5])
    assert len(set(alone)) == 1 and mixed == alone[0]


def test_filter_top_k_top_p_keeps_at_least_one_token():
    scaled = torch.tensor([[5.0, 0.0, -1.0], [1.0, 1.0, 1.0]])
    out = filter_top_k_top_p(scaled, [-1, 1], [1e-6, 1.0])
    assert torch.isfinite(out).sum(-1).tolist() == [1, 1]
    assert math.isinf(out[0, 1].item())


def test_reused_plan_draws_like_fresh_settings():
    """A SamplingPlan built once and reused step after step gives the numbers of per-step lists."""
    from verl_async.rollout.native.sampler import SamplingPlan, sample_with_plan

    settings = ([0.7, 0.0, 1.3, 1.0, 0.0], [-1, 3, 0, 4, 2], [1.0, 0.9, 0.5, 1.0, 1.0])
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(1))

    def seeded():
        return [None, None, torch.Generator().manual_seed(3), None, torch.Generator().manual_seed(4)]

    gens_a, gens_b = seeded(), seeded()
    default_a, default_b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    plan = SamplingPlan(*settings, gens_b, vocab=10)
    for _ in range(4):
        ta, la = sample_tokens(logits, *settings, gens_a, default_a)
        tb, lb = sample_with_plan(logits, plan, default_b)
        assert torch.equal(ta, tb) and torch.equal(la, lb)
