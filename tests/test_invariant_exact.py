"""verl_async.invariant.exact: the exact linear for any K, row count and magnitude spread (CPU; hypothesis).

tests/test_invariant_ops.py checks the kernels built on it (and the swap of the BLAS under them)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_async.invariant import exact


@settings(max_examples=40, deadline=None, derandomize=True)
@given(k=st.integers(1, 2500), n=st.integers(1, 40), rows=st.integers(2, 70), spread=st.integers(0, 24),
       seed=st.integers(0, 2**31 - 1), bias=st.booleans())
def test_exact_linear_rows_are_independent_and_within_float32_rounding(k, n, rows, spread, seed, bias):
    """Any K, any row count, magnitudes spread over 2^-spread..2^spread: row r's bits are those it gets alone
    and in any chunking, and its error against float64 stays at float32 rounding size (|x|_1 max|w| 2^-23)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.exp2(torch.randint(-spread, spread + 1, (rows, k), generator=gen))
    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-spread, spread + 1, (n, k), generator=gen)) / 8
    b = torch.randn(n, generator=gen) if bias else None
    grid = exact.weight_grid(w)
    out = exact.linear(x, grid, b)
    r = int(torch.randint(rows, (1,), generator=gen))
    assert torch.equal(exact.linear(x[r : r + 1], grid, b)[0], out[r])
    ref = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    bound = 2.0 ** -23 * (ref.abs() + x.double().abs().sum(-1, keepdim=True) * w.double().abs().amax(-1)[None, :])
    assert bool(((out.double() - ref).abs() <= bound).all())


def test_round_to_integer_is_torch_round_below_2_to_51():
    values = torch.cat([torch.randn(20000, dtype=torch.float64) * 10.0 ** k for k in range(15)]
                       + [torch.arange(-6, 6, dtype=torch.float64) + 0.5, torch.tensor([2.0 ** 51 - 0.5, -0.0])])
    assert torch.equal(exact.round_to_integer(values), torch.round(values))


def test_row_exponents_and_pow2_are_exact():
    a = torch.tensor([[0.0, 0.0], [0.75, -3.0], [2.0 ** -140, 0.0], [-(2.0 ** 100), 1.0]], dtype=torch.float64)
    assert exact.row_exponents(a).flatten().tolist() == [0, 2, -139, 101]  # max|a| < 2^e, 0 for a zero row
    e = torch.arange(-1022, 1024)
    assert torch.equal(exact.pow2(e), torch.tensor([2.0 ** int(k) for k in e], dtype=torch.float64))
