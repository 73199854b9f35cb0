"""Batch-invariant linear, RMSNorm and SiLU: each row's result is the same whatever rows share the call.

Pure tensor functions. On CPU the linear's GEMM and the norm's sum are exact (exact.py: no
BLAS, thread count or row count can change a bit); on CUDA the linear and the norm are single
Triton launches whose summation order depends on the weight only (triton_ops.py), and without
triton every call has a fixed shape (shapes.py says why). Only the forward values must be invariant: backward passes use plain
full-size kernels (a gradient need not match anything bit for bit), so training pays the
invariant forward once, not three times.

Elementwise ops on CPU: torch runs a tensor's bulk through SIMD code and the leftover elements
of each thread's range through scalar code, and for `rsqrt`, `sigmoid`, `silu` and `gelu` the
two disagree in the last bit (measured: thousands of elements for rsqrt), so which path an
element takes depends on the tensor's size. These functions use only ops whose two paths agree
(+, -, *, /, sqrt, exp, log, cos, sin, dtype casts: measured equal over 10^6 values of each
dtype); CUDA applies one code path per element anyway.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from verl_async.invariant import exact, triton_ops


def map_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: Optional[int]) -> torch.Tensor:
    """`fn` (a row-wise function of a [n, ...] tensor) applied to calls of exactly `rows` rows.

    The last chunk is padded with zero rows and its padding dropped. `rows=None`: one call,
    padded to 2 rows when it has 1 (a single-row CPU reduction over >= 32768 elements is split
    across threads; two rows never are).
    """
    n = x.shape[0]
    if rows is None:
        if n >= 2:
            return fn(x)
        return fn(torch.cat([x, x.new_zeros((2 - n, *x.shape[1:]))]))[:n]
    if n == rows:
        return fn(x)
    outs = [fn(x[s : s + rows]) for s in range(0, n - n % rows, rows)]
    tail = n % rows
    if tail:
        padded = torch.cat([x[n - tail :], x.new_zeros((rows - tail, *x.shape[1:]))])
        outs.append(fn(padded)[:tail])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _fixed_rows_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], rows: Optional[int],
                       out: torch.Tensor) -> torch.Tensor:
    """Fill `out` [n, out_features] with x2d @ weight.T (+ bias), `rows` rows per GEMM (None: one GEMM)."""
    n = x2d.shape[0]
    if rows is None:
        rows = max(n, 1)
    wt = weight.t()
    full = n - n % rows
    for s in range(0, full, rows):
        if bias is None:
            torch.mm(x2d[s : s + rows], wt, out=out[s : s + rows])
        else:
            torch.addmm(bias, x2d[s : s + rows], wt, out=out[s : s + rows])
    if full < n:
        padded = x2d.new_zeros((rows, x2d.shape[1]))
        padded[: n - full] = x2d[full:]
        last = torch.mm(padded, wt) if bias is None else torch.addmm(bias, padded, wt)
        out[full:] = last[: n - full]
    return out


class _InvariantLinear(torch.autograd.Function):
    """Forward: `_forward` (exact on CPU, fixed row chunks elsewhere); backward with whole-tensor GEMMs
    (F.linear's gradient)."""

    @staticmethod
    def forward(ctx, x, weight, bias, rows, grid):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _forward(x, weight, bias, rows, grid)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        g2d = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g2d @ weight).view_as(x)
        if ctx.needs_input_grad[1]:
            gw = g2d.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2d.sum(0)
        return gx, gw, gb, None, None


def _forward(x, weight, bias, rows, grid):
    if triton_ops.use_triton(x.device):  # CUDA: one launch for any row count (issue 41), no chunks
        return triton_ops.linear_forward(x, weight, bias)
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))  # not a view: FSDP2 hooks the root's output
    if x.device.type == "cpu":
        return exact.linear(x, grid if grid is not None else exact.weight_grid(weight), bias, out)
    _fixed_rows_linear(x.reshape(-1, x.shape[-1]), weight, bias, rows, out.view(-1, weight.shape[0]))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], rows: Optional[int],
           grid: Optional[exact.WeightGrid] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, a row's bits independent of the others: on CPU with exact sums (`grid`:
    the weight's `exact.weight_grid`, when the caller keeps one), elsewhere `rows` rows per GEMM (x's
    leading dims flattened; None: one GEMM)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _InvariantLinear.apply(x, weight, bias, rows, grid)
    return _forward(x, weight, bias, rows, grid)  # no graph to record: the same forward, without autograd's


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, reduce_rows: Optional[int]) -> torch.Tensor:
    """HF's Llama/Qwen RMSNorm (float32 inside, the weight applied in the input dtype), with the
    variance as an exact sum on CPU (a fixed-shape row reduction elsewhere) and `1 / sqrt` for
    `rsqrt` (whose CPU paths disagree)."""
    if triton_ops.use_triton(x.device):  # one launch, one program per row (issue 41)
        return triton_ops.rms_norm(x, weight, eps)
    dtype = x.dtype
    h = x.float()
    flat = h.reshape(-1, h.shape[-1])
    if x.device.type == "cpu":
        squares = flat.detach().to(torch.float64).square()  # exact: a float32 squared fits a float64
        variance = (exact.sum_last(squares) / flat.shape[-1]).to(torch.float32)
        if flat.requires_grad:  # the exact value, the plain mean's gradient (plain - plain.detach() is exactly 0)
            plain = flat.pow(2).mean(-1, keepdim=True)
            variance = variance + (plain - plain.detach())
    else:
        variance = map_rows(lambda t: t.pow(2).mean(-1, keepdim=True), flat, reduce_rows)
    variance = variance.view(*h.shape[:-1], 1)
    normed = h / torch.sqrt(variance + eps)
    return weight * normed.to(dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in float32 (rounded once to x's dtype, as torch's kernel does); on CPU from
    exp and a division, whose SIMD and scalar paths agree (torch's silu's do not)."""
    if x.device.type != "cpu":
        return torch.nn.functional.silu(x)
    h = x.float()
    return (h / (1.0 + torch.exp(-h))).to(x.dtype)
