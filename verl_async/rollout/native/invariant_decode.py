"""True on-policy mode's decode step: FastDecoder's short path through the trainer's own kernels (issue 41).

In the mode the model is patched with the batch-invariant kernels (`verl_async.invariant.make_invariant`) and
the engine's log-probs must equal the trainer's bit for bit. The HF forward gives that, but costs ~43 launches
per layer (views, transposes, `rotate_half` cats, mask plumbing), and a decode step of a small model is paid
per launch. `InvariantDecoder` runs the same arithmetic in ~17: each op below is the one HF's decoder layer
calls, on the same values, so every element gets the same bits.

    input RMSNorm | q, k, v projections | [qwen3: q_norm, k_norm] | rotary + K/V into the cache
    (`invariant.rope`: HF's formula's roundings, one launch on CUDA) | attention over the slot
    (`invariant.attention.canonical_attention`, the trainer's kernel) | o_proj, + residual | post RMSNorm |
    gate, up, SiLU, *, down, + residual ... final norm, LM head

On CUDA q/k/v and gate/up run as one launch each of the same invariant linear over FastDecoder's fused weight
buffers (the modules' parameters are its row blocks): an output column's sum is the same K walk whichever columns
share its tile; and o_proj and down_proj add into the residual stream inside their launch (the product rounded,
then the sum, as HF's `residual + o_proj(...)` rounds them). Both are checked on the real weights at start
(`_fusion_problem`; VERL_ASYNC_INVARIANT_FUSE_PROJECTIONS=0 keeps everything apart). What FastDecoder does that changes bits is not done: no `addmm` residual, no rotation-matrix
rotary, no `F.rms_norm`. Masks are not built: the attention kernel reads each row's position from the device
tensor and the keys it may see from that, so a step has one shape per batch bucket, no host sync, and runs inside
the runner's CUDA graphs (`runner.ModelRunner._new_graph`); the same function runs eagerly on CPU (projections
apart: the exact linear keeps each module's weight grid), where the tests hold it to the trainer's bits.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import torch

from verl_async.invariant import triton_ops
from verl_async.invariant.attention import ATTENTION_NAME, canonical_attention
from verl_async.invariant.ops import linear
from verl_async.invariant.rope import rope_into_cache, rope_problem
from verl_async.invariant.shapes import shapes_for
from verl_async.rollout.native.fast_decode import FastDecoder, FusedLinear
from verl_async.rollout.native.kv_cache import SlotKVCache

logger = logging.getLogger(__name__)


def _apply_rotary(layer: torch.nn.Module):
    """The `apply_rotary_pos_emb` of the module that defines this decoder layer's attention (HF's own)."""
    fn = getattr(sys.modules[type(layer.self_attn).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        raise ValueError(f"true on-policy decode: {type(layer.self_attn).__module__} has no apply_rotary_pos_emb")
    return fn


FUSE_ENV = "VERL_ASYNC_INVARIANT_FUSE_PROJECTIONS"  # "0": q/k/v and gate/up as separate launches


def _linear(x: torch.Tensor, fused: FusedLinear) -> torch.Tensor:
    """The invariant linear (what each patched module calls) over a fused weight: on CUDA one Triton launch whose
    output column j is computed as the module owning weight row j computes it alone (same K walk, same tile)."""
    return linear(x, fused.weight, fused.bias, shapes_for(x.device).linear_rows)


def _add_linear_(x: torch.Tensor, module: torch.nn.Module, inp: torch.Tensor, fused: bool) -> torch.Tensor:
    """x + module(inp) (HF's residual add), in place: on CUDA added inside the linear's launch (`add_to`)."""
    if fused:
        return triton_ops.linear_forward(inp, module.weight, module.bias, add_to=x)
    return x.add_(module(inp))


def _fusion_problem(layers, residual: bool = True) -> Optional[str]:
    """Why a fused projection's columns are not the modules' own outputs, or a residual added inside the linear's
    launch is not `residual + module(x)`, here (a probe over each layer's real weights at 1 and 64 rows), or None.
    FastDecoder fuses for speed alone; here equal bits are the point."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            for module in (layer.o_proj, layer.down_proj) if residual else ():
                x = torch.randn(64, module.weight.shape[1], generator=gen).to(module.weight)
                res = torch.randn(64, module.weight.shape[0], generator=gen).to(module.weight)
                for rows in (1, 64):
                    if not torch.equal(_add_linear_(res[:rows].clone(), module, x[:rows], True),
                                       res[:rows] + module(x[:rows])):
                        return f"layer {i}: a residual added inside the linear differs from residual + linear"
            for fused, parts in ((layer.qkv, (layer.q_proj, layer.k_proj, layer.v_proj)),
                                 (layer.gate_up, (layer.gate_proj, layer.up_proj))):
                if fused is None:
                    continue
                x = torch.randn(64, fused.weight.shape[1], generator=gen).to(fused.weight)
                for rows in (1, 64):
                    outs = _linear(x[:rows], fused).split(fused.sizes, dim=-1)
                    if not all(torch.equal(out, part(x[:rows])) for out, part in zip(outs, parts)):
                        return f"layer {i}: a fused projection's columns differ from its modules' outputs"
    return None


class InvariantDecoder(FastDecoder):
    """One decode step of a model `make_invariant` patched, with the bits of its HF forward (see the module)."""

    def __init__(self, model: torch.nn.Module, cache: SlotKVCache, layer_types: list[str], span: int,
                 sliding_window: Optional[int] = None) -> None:
        device = model.get_input_embeddings().weight.device
        fuse = triton_ops.use_triton(device) and os.environ.get(FUSE_ENV, "1") != "0"
        super().__init__(model, cache, layer_types, fuse_projections=fuse, attention=(ATTENTION_NAME,))
        self.span = int(span)
        self.fusion_problem = _fusion_problem(self.layers) if fuse else "not on CUDA with triton"
        self.fuse_residual = self.fusion_problem is None
        if self.fusion_problem is not None:  # the modules (views of the fused buffers, or their own weights)
            self.layers = [layer._replace(qkv=None, gate_up=None) for layer in self.layers]
            if fuse:
                logger.warning("true on-policy decode: projections unfused: %s", self.fusion_problem)
        hf_layers = list(model.model.layers)[: len(self.layers)]
        # the window HF hands the attention: the layer's own attribute (qwen2, qwen3), else the config's (mistral)
        self.windows = [getattr(layer.self_attn, "sliding_window",
                                sliding_window if kind == "sliding_attention" else None) or None
                        for layer, kind in zip(hf_layers, self.layer_types)]
        self.apply_rotary = _apply_rotary(hf_layers[0])
        if any(_apply_rotary(layer) is not self.apply_rotary for layer in hf_layers):
            raise ValueError("true on-policy decode: the layers' rotary functions differ")
        # the rotary kernel only where it gives this function's bits on this device (probed once, before any graph)
        weight = self.embed_tokens.weight
        self.rope_problem = (rope_problem(self.apply_rotary, weight.dtype, self.head_dim, weight.device)
                             if triton_ops.use_triton(weight.device) else "not on CUDA with triton")
        self.rope_kernel = self.rope_problem is None
        if weight.device.type == "cuda" and not self.rope_kernel:
            logger.warning("true on-policy decode: rotary through the model's function: %s", self.rope_problem)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, masks=None, kv_len: int = 0) -> torch.Tensor:
        """[B] token ids at [B] positions -> [B, V] float32 logits; each row attends to keys [0, kv_len) of its
        slot (on CUDA the whole span; on CPU the keys in use). `masks` is ignored (the kernel masks)."""
        batch, heads, kv_heads, dim = ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        cache = self.cache
        x = self.embed_tokens(ids)  # [B, hidden]; fresh, so the residual stream is updated in place below
        cos, sin = self.rotary_emb(x, positions[:, None])  # [B, 1, D]: what HF's model computes once per forward
        q_pos = positions[:, None]
        for i, layer in enumerate(self.layers):
            h = layer.input_norm(x)
            if layer.qkv is not None:  # one launch; q, k, v are column blocks (views) of its output
                q, k, v = _linear(h, layer.qkv).split(layer.qkv.sizes, dim=-1)
            else:
                q, k, v = layer.q_proj(h), layer.k_proj(h), layer.v_proj(h)
            q, k, v = q.view(batch, heads, dim), k.view(batch, kv_heads, dim), v.view(batch, kv_heads, dim)
            if layer.q_norm is not None:  # qwen3: RMSNorm over head_dim per head, before rotary
                q, k = layer.q_norm(q), layer.k_norm(k)
            k_cache, v_cache = cache.k[i], cache.v[i]
            q = rope_into_cache(q, k, v, cos, sin, positions, k_cache, v_cache, self.apply_rotary,
                                use_kernel=self.rope_kernel)
            attn = canonical_attention(q.view(batch, kv_heads, self.groups, 1, dim), k_cache[:batch, :, :kv_len],
                                       v_cache[:batch, :, :kv_len], q_pos, scale=layer.scaling,
                                       window=self.windows[i], span=self.span)
            x = _add_linear_(x, layer.o_proj, attn.reshape(batch, heads * dim), self.fuse_residual)
            h = layer.post_norm(x)
            if layer.gate_up is not None:
                gate, up = _linear(h, layer.gate_up).split(layer.gate_up.sizes, dim=-1)
            else:
                gate, up = layer.gate_proj(h), layer.up_proj(h)
            x = _add_linear_(x, layer.down_proj, layer.act_fn(gate) * up, self.fuse_residual)
        return self.lm_head(self.norm(x)).float()
