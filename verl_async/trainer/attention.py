"""Attention for the padding-free (packed) forward.

A packed micro-batch is ONE row holding several sequences back to back, with
`position_ids` restarting at 0 for each sequence. Three ways to keep the sequences
from attending to each other:

* `flash_attention_2` (when `flash_attn` is installed): transformers passes our
  `cu_seq_lens_*` / `max_length_*` kwargs to the varlen kernel.
* `sdpa`: transformers 5 detects packing from `position_ids` when no attention mask
  is given (masking_utils.find_packed_sequence_indices) and builds a block-diagonal
  causal mask. Correct everywhere, but the mask is dense [N, N] and sdpa can then
  not use its flash kernel, so attention costs O(N^2) per packed row.
* `varlen` (ours, registered below): on CUDA, torch's own flash-attention varlen
  kernel (`torch.nn.attention.varlen.varlen_attn`, torch >= 2.9; its signature moved
  from `is_causal` to `window_size` and gained `scale`/`enable_gqa` later, all handled)
  with the same `cu_seqlens`; elsewhere (CPU, NPU, older torch) a per-sequence causal
  sdpa loop. Sliding-window layers (Mistral, Qwen2 with `use_sliding_window`) keep their
  window: the layer passes `sliding_window` and both paths apply it.
  Padded inputs (a 2D attention mask) go through transformers' sdpa path unchanged.

`resolve_attn_implementation` picks one for `actor_rollout_ref.model.attn_implementation`.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Optional

import torch
import torch.nn.functional as F

VARLEN = "varlen"


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@functools.lru_cache(maxsize=None)
def _torch_varlen():
    """(varlen_attn, its keyword names) or None when this torch has no varlen kernel."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def resolve_attn_implementation(requested: str, device: str) -> str:
    """`auto`: flash_attention_2 if installed on CUDA, else `varlen`.

    Not sdpa: for packed rows transformers builds a dense [N, N] block-diagonal mask, so
    attention costs N^2 over the whole pack instead of the sum of per-sequence squares
    (measured on the CPU demo: 2.8x slower steps than varlen's per-sequence path).
    """
    if requested == "auto":
        requested = "flash_attention_2" if device == "cuda" and flash_attn_available() else VARLEN
    if requested == "flash_attention_2" and not flash_attn_available():
        raise ValueError("actor_rollout_ref.model.attn_implementation=flash_attention_2 but flash_attn is not "
                         "installed; use sdpa or varlen")
    if requested == VARLEN:
        register_varlen_attention()
    return requested


def _window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """Query i sees keys (i - window, i]: HF's sliding-window rule (masking_utils.sliding_window_overlay)."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    return (k <= q) & (k > q - window)


def _causal_sdpa_loop(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                      scaling: Optional[float], sliding_window: Optional[int] = None) -> torch.Tensor:
    """[1, H, N, D] inputs -> [1, N, H, D]; exact per-sequence causal (optionally sliding) attention, any device."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    bounds = cu_seqlens.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e <= s:
            continue
        q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
        if sliding_window and e - s > sliding_window:
            mask = _window_mask(e - s, sliding_window, query.device)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling))
        else:
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2)


def _causal_varlen_cuda(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_len: int, scaling: Optional[float], sliding_window: Optional[int] = None) -> torch.Tensor:
    varlen_attn, params = _torch_varlen()
    q = query[0].transpose(0, 1)  # [N, H, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    kwargs: dict = {}
    if "scale" in params:
        kwargs["scale"] = scaling
    if "is_causal" in params:  # torch 2.9/2.10; later versions express causality as a window
        kwargs["is_causal"] = True
    else:  # flash-attention's window: keys [i - left, i + right]
        kwargs["window_size"] = (sliding_window - 1 if sliding_window else -1, 0)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, int(max_len), int(max_len), **kwargs)
    return out.unsqueeze(0)  # [1, N, H, D]


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: (module, q, k, v, mask, ...) -> ([B, L, H, D], None)."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention expects one packed row, got batch {query.shape[0]}")
    max_len = kwargs.get("max_length_q")
    # layers of sliding-window models get their window here (Mistral: every layer; Qwen2: sliding layers)
    window = kwargs.get("sliding_window") or None
    kernel = _torch_varlen()
    default_scale = scaling is None or abs(scaling - query.shape[-1] ** -0.5) < 1e-9
    use_kernel = (query.is_cuda and kernel is not None and query.dtype in (torch.bfloat16, torch.float16)
                  and (default_scale or "scale" in kernel[1]) and (window is None or "window_size" in kernel[1]))
    if use_kernel:
        out = _causal_varlen_cuda(query, key, value, cu_seqlens, int(max_len), scaling, window)
    else:
        out = _causal_sdpa_loop(query, key, value, cu_seqlens, scaling, window)
    return out, None


def _varlen_mask(*args, attention_mask=None, **kwargs):
    """No dense mask for packed/causal inputs (the kernel uses cu_seqlens); sdpa's mask for padded rows."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


@functools.lru_cache(maxsize=None)
def register_varlen_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, _varlen_mask)
