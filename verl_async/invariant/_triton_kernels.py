"""The Triton kernels behind `triton_ops` (imported only from there, and only when a kernel is called).

Why a row's bits cannot depend on its batch:
- matmul: one program per [BLOCK_M, BLOCK_N] output tile, K walked in BLOCK_K steps from 0 upwards into one
  float32 accumulator (no split-K, no stream-K, no atomics). The block sizes, warps and stages are launch
  constants chosen from the weight's shape and dtype, never from M, so every row meets the same compiled kernel
  and the same sequence of `tl.dot`s, whatever rows share its tile and wherever it sits in it. Rows past M are
  loaded as zeros; they change no other row. M is not specialized (`do_not_specialize`): a call with M == 1
  compiles the same kernel as M == 4096.
- RMSNorm: one program per row; the row's squares are added into a BLOCK-wide float32 vector chunk by chunk in
  order and the vector reduced once (`tl.sum`, a tree fixed by BLOCK and num_warps, both functions of the hidden
  size only).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def linear_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, K,
                  stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                  HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped tile order (tiles of GROUP_M row blocks share weight tiles in L2): which program computes a tile
    # never changes what the tile's arithmetic is.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M x N passes 2**31 at 16k rows x 152k vocab
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # the [BLOCK_K, BLOCK_N] tile of w.T
    row_ok = offs_m[:, None] < M
    col_ok = offs_n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(x_ptrs, mask=row_ok & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & col_ok, other=0.0)
        if UPCAST:  # interpreter only: its tl.dot multiplies bfloat16's raw uint16 storage (exact in float32 anyway)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:  # float32 inputs: float32 products, as torch's default (no TF32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    o_ptrs = o_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=row_ok & col_ok)


@triton.jit(do_not_specialize=["M"])
def rms_norm_kernel(x_ptr, w_ptr, o_ptr, M, H, stride_xm, stride_om, eps,
                    BLOCK: tl.constexpr):
    """HF's Llama/Qwen RMSNorm of one row: float32 inside, `h / sqrt(mean(h^2) + eps)` rounded to x's dtype,
    then times the weight (as torch's `weight * normed.to(dtype)`: a float32 product rounded once)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, H, BLOCK):
        h = tl.load(x_row + start + cols, mask=start + cols < H, other=0.0).to(tl.float32)
        acc += h * h
    variance = tl.math.div_rn(tl.sum(acc, axis=0), H * 1.0)
    denom = tl.sqrt_rn(variance + eps)
    for start in range(0, H, BLOCK):
        ok = start + cols < H
        x = tl.load(x_row + start + cols, mask=ok, other=0.0)
        normed = tl.math.div_rn(x.to(tl.float32), denom).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + start + cols, mask=ok, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(o_ptr + row * stride_om + start + cols, out.to(o_ptr.dtype.element_ty), mask=ok)
