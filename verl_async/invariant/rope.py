"""A decode step's rotary embedding with HF's bits, the new keys and values written into the KV cache.

HF's Llama-family `apply_rotary_pos_emb` computes `x * cos + rotate_half(x) * sin` in the tensors' dtype: each of
the two products and the sum rounded once. The trainer's forward gets its bits through that function; the engine's
decode step (`rollout/native/invariant_decode.py`) must get the same ones, without HF's ~12 launches per layer (a
product, a negation, a cat, a product and a sum per tensor, two cache writes). On CUDA (`triton_ops.use_triton`)
one Triton launch does it (`_triton_kernels.rope_cache_kernel`: float32 products of 16-bit values are exact, each
result rounded to nearest even, no FMA contraction, so every element is torch's); elsewhere the model's own
function and two index writes. `rope_problem` probes the two against each other before the kernel is trusted.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from verl_async.invariant import triton_ops

RotaryFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # HF's apply_rotary_pos_emb(q, k, cos, sin)


def _torch_rope(q, k, v, cos, sin, positions, k_cache, v_cache, apply_rotary: RotaryFn) -> torch.Tensor:
    q4, k4 = apply_rotary(q[:, :, None], k[:, :, None], cos, sin)  # [B, heads, 1, D]; cos [B, 1, D] -> [B, 1, 1, D]
    rows = torch.arange(q.shape[0], device=q.device)
    k_cache[rows, :, positions] = k4[:, :, 0]
    v_cache[rows, :, positions] = v
    return q4[:, :, 0]


def _kernel_rope(q, k, v, cos, sin, positions, k_cache, v_cache) -> torch.Tensor:
    B, H, D = q.shape
    G = k.shape[1]
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    c, s = cos.reshape(B, D), sin.reshape(B, D)
    c, s = (t if t.stride(-1) == 1 else t.contiguous() for t in (c, s))
    half = D // 2
    triton_ops._kernels().rope_cache_kernel[(B, H + G)](
        q, k, v, c, s, positions, out, k_cache, v_cache, H,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), c.stride(0), s.stride(0),
        out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        HALF=half, BLOCK=max(16, 1 << max(half - 1, 1).bit_length()), enable_fp_fusion=False)
    return out


def _kernel_fits(q, k, v, cos, sin, k_cache, v_cache) -> bool:
    D = q.shape[-1]
    return (q.dtype in (torch.bfloat16, torch.float16, torch.float32) and D % 2 == 0
            and all(t.dtype == q.dtype for t in (k, v, cos, sin, k_cache, v_cache))
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1)


def rope_into_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, apply_rotary: RotaryFn,
                    use_kernel: Optional[bool] = None) -> torch.Tensor:
    """q [B, H, D], k and v [B, G, D] of one new token per row b; cos, sin [B, 1, D] (the model's rotary embedding
    at `positions` [B]). Writes rotated k and v into `k_cache`, `v_cache` [slots, G, L, D] at (b, :, positions[b])
    and returns the rotated q [B, H, D]: HF's `apply_rotary_pos_emb` bit for bit. `use_kernel` (default: where
    `triton_ops.use_triton` and the dtypes fit) picks the Triton launch."""
    if use_kernel is None:
        use_kernel = triton_ops.use_triton(q.device) and _kernel_fits(q, k, v, cos, sin, k_cache, v_cache)
    if use_kernel:
        return _kernel_rope(q, k, v, cos, sin, positions, k_cache, v_cache)
    return _torch_rope(q, k, v, cos, sin, positions, k_cache, v_cache, apply_rotary)


def rope_problem(apply_rotary: RotaryFn, dtype: torch.dtype, head_dim: int, device: torch.device) -> Optional[str]:
    """Why the kernel does not give `apply_rotary`'s bits here (a probe over random values at many positions), or
    None. Run once before a decoder trusts the kernel: a model family whose function is not HF's standard formula
    is caught here and keeps the function."""
    gen = torch.Generator().manual_seed(0)
    B, H, G, L = 16, 4, 2, 8
    q, k, v = (torch.randn(B, n, head_dim, generator=gen).to(device, dtype) for n in (H, G, G))
    angle = torch.randint(0, 100_000, (B, 1, 1), generator=gen) * torch.rand(1, 1, head_dim // 2, generator=gen)
    angle = torch.cat([angle, angle], dim=-1)
    cos, sin = angle.cos().to(device, dtype), angle.sin().to(device, dtype)
    positions = torch.randint(0, L, (B,), generator=gen).to(device)
    got, want = [], []
    for kernel, out in ((True, got), (False, want)):
        caches = [torch.zeros(B, G, L, head_dim, dtype=dtype, device=device) for _ in range(2)]
        out.extend([rope_into_cache(q, k, v, cos, sin, positions, *caches, apply_rotary, use_kernel=kernel), *caches])
    for name, a, b in zip(("query", "key cache", "value cache"), got, want):
        if not torch.equal(a, b):
            return f"the rotary kernel's {name} differs from the model's apply_rotary_pos_emb in {dtype}"
    return None
