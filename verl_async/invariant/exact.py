"""Exact sums: the CPU kernels of true on-policy mode, whose results no summation order can change.

A float32 GEMM's result depends on the order its library adds the products in, and that order
depends on the row count, the thread count, the library (MKL, OpenBLAS, ...) and the processor
(AVX2, AVX-512). Here every sum that decides a reported number is made EXACT instead: each
operand row is put on an integer grid (`a ≈ 2^(e-bits) * round(a * 2^(bits-e))`, with `e` from
that row's own largest element), so every product is an integer and every partial sum an integer
below 2^53, which float64 holds exactly. A float64 GEMM (any BLAS, any blocking, any thread
split, FMA or not) then returns THE integer result, and the rest is elementwise float64 math in a
fixed order. A row's result depends only on its own data and the reduction length K: not on how
many rows share the call, where it sits, or which machine's BLAS ran it. (Ozaki, Ogita, Oishi,
Rump 2012 use the same splitting for accurate and reproducible BLAS.)

Precision: a weight row on a 24-bit grid of its largest element (every weight within a factor
2 of it exact, smaller ones rounded to that grid: float32 GEMM's own rounding size), an
activation row in slices of `53 - 24 - ceil(log2 K)` bits each, as many as give >= 36 bits
(2 for K <= 4096): the result is within a few float32 ulps of the exact dot product, usually
closer than float32 GEMM's. The price is float64 GEMMs with one row per activation slice
(measured in docs/true_on_policy.md).

The one assumption: the library computes a float64 GEMM from float64 products and sums (no
Strassen-like transform, no reduced precision), which every CPU BLAS does.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

MANTISSA_BITS = 53  # float64: every integer of magnitude <= 2^53 is exact
WEIGHT_BITS = 24  # a weight row's grid: float32's significand, relative to the row's largest element
ACTIVATION_BITS = 36  # at least this many bits of an activation row, in slices
ROWS_BUDGET = 1 << 25  # float64 elements of one GEMM's output: rows go through in chunks of this size
# (exact results do not depend on the chunking; it only bounds memory)


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The library GEMM every exact product goes through (the tests swap in another library's)."""
    return torch.mm(a, b)


def batched_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, b)


def ceil_log2(n: int) -> int:
    return max(int(n) - 1, 0).bit_length()


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2.0 ** exponent as float64, exactly (built from its bits; the exponent is clamped to float64's normal range)."""
    e = exponent.to(torch.int64).clamp(-1022, 1023)
    return ((e + 1023) << 52).view(torch.float64)


ROUNDER = 1.5 * 2.0 ** 52  # (s + ROUNDER) - ROUNDER rounds s to the nearest integer (ties to even) for |s| < 2^51


def round_to_integer(s: torch.Tensor) -> torch.Tensor:
    """`torch.round` of float64 values below 2^51 in magnitude, by IEEE addition alone: the same bits on any
    machine, and fast (torch.round of float64 values of 2^19-2^22 measured 1000x slower on this CPU)."""
    return (s + ROUNDER).sub_(ROUNDER)


def row_exponents(a: torch.Tensor) -> torch.Tensor:
    """[..., K] float64 -> [..., 1] int64 `e` with max|a| < 2^e (0 for an all-zero row)."""
    low, high = torch.aminmax(a, dim=-1, keepdim=True)  # one pass, no |a| copy
    _, e = torch.frexp(torch.maximum(high, low.neg_()))
    return e.to(torch.int64)


def grid_slices(a: torch.Tensor, e: torch.Tensor, bits: int, slices: int) -> torch.Tensor:
    """[slices, ..., K] integer-valued float64 `s_j` with a ≈ 2^(e-bits) * sum_j s_j 2^(-j bits).

    |s_0| <= 2^bits, |s_j| <= 2^(bits-1) after it; every step is exact (power-of-two scaling,
    rounding to an integer, subtracting it)."""
    s = a * pow2(bits - e)
    out = torch.empty((slices, *a.shape), dtype=torch.float64, device=a.device)
    for j in range(slices):
        hi = torch.add(s, ROUNDER, out=out[j]).sub_(ROUNDER)  # round_to_integer, into its slot
        if j + 1 < slices:
            s.sub_(hi).mul_(2.0 ** bits)
    return out


def activation_bits(k: int) -> int:
    """Bits per activation slice for a reduction of length k (exact: k * 2^(bits + WEIGHT_BITS) <= 2^53)."""
    bits = MANTISSA_BITS - WEIGHT_BITS - ceil_log2(k)
    if bits < MIN_BITS:
        raise ValueError(f"true_on_policy exact linear: a reduction of length {k} is too long for exact float64 sums")
    return bits


MIN_BITS = 8


def length_problem(lengths: dict[str, int]) -> Optional[str]:
    """Why a reduction of one of these lengths (name -> length) cannot be summed exactly here, or None."""
    for name, k in lengths.items():
        if MANTISSA_BITS - WEIGHT_BITS - ceil_log2(k) < MIN_BITS:
            return (f"{name}={k} is longer than exact float64 sums allow "
                    f"(<= {2 ** (MANTISSA_BITS - WEIGHT_BITS - MIN_BITS)})")
    return None


def activation_slices(k: int) -> int:
    return math.ceil(ACTIVATION_BITS / activation_bits(k))


class WeightGrid(NamedTuple):
    """A [N, K] weight on its rows' 24-bit grids: weight[n] ≈ ints[n] * 2^(exponents[n] - 24)."""

    ints: torch.Tensor  # [N, K] float64, integer-valued, |.| <= 2^24
    exponents: torch.Tensor  # [N] int64


def weight_grid(weight: torch.Tensor) -> WeightGrid:
    w = weight.detach().to(torch.float64)
    e = row_exponents(w)
    return WeightGrid(grid_slices(w, e, WEIGHT_BITS, 1)[0], e[:, 0])


def linear(x: torch.Tensor, grid: WeightGrid, bias: Optional[torch.Tensor] = None,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` with exact sums, rounded once to x's dtype: [..., K] -> [..., N] (into `out`)."""
    k = x.shape[-1]
    n = grid.ints.shape[0]
    if grid.ints.shape[1] != k:
        raise ValueError(f"true_on_policy exact linear: input has {k} features, the weight {grid.ints.shape[1]}")
    bits, slices = activation_bits(k), activation_slices(k)
    x2 = x.detach().reshape(-1, k)
    if out is None:
        out = x.new_empty((*x.shape[:-1], n))
    out2 = out.view(-1, n)
    m = x2.shape[0]
    chunk = max(1, ROWS_BUDGET // max(1, slices * n))
    col_scale = pow2(grid.exponents - (bits + WEIGHT_BITS))[None, :]
    b64 = bias.detach().to(torch.float64) if bias is not None else None
    wt = grid.ints.t()
    for s in range(0, m, chunk):
        xs = x2[s : s + chunk].to(torch.float64)
        e = row_exponents(xs)
        parts = gemm(grid_slices(xs, e, bits, slices).view(-1, k), wt).view(slices, -1, n)
        acc = parts[slices - 1]
        for j in range(slices - 2, -1, -1):  # Horner, lowest slice first: a fixed order of float64 adds
            acc = parts[j] + acc * 2.0 ** -bits
        acc = acc * pow2(e) * col_scale  # two exact power-of-two scalings
        if b64 is not None:
            acc = acc + b64
        out2[s : s + chunk] = acc
    return out


def sum_last(a: torch.Tensor, length: Optional[int] = None) -> torch.Tensor:
    """Sum over the last dim of a float64 tensor, exact up to a 2^-(53 - ceil(log2 length)) grid of its row's
    largest element: the same bits in any order. `length` (default: the dim's size) fixes the grid when the
    row may carry zero padding that the other side does not: a sum over a longer span must use its length."""
    length = a.shape[-1] if length is None else length
    bits = min(MANTISSA_BITS - ceil_log2(length), 50)
    e = row_exponents(a)
    return round_to_integer(a * pow2(bits - e)).sum(-1, keepdim=True) * pow2(e - bits)
