"""A decode step with few kernels for Llama-like HF models (llama, mistral, qwen2, qwen3).

Why: a decode step is one new token per row, so every tensor is tiny and the step time on a
GPU is the number of kernels (~1.5-3.5 us each), not bandwidth. The HF forward spends ~43
kernels per layer on generic machinery (transposes, `repeat_kv`/`contiguous` copies,
`rotate_half` cats, the RMSNorm's 6 elementwise ops, the mask plumbing). `FastDecoder`
computes the same numbers from the same modules and weights (float32: within ~1e-6; bf16: a few
ops round once where HF rounds twice, differences at bf16 rounding level) in ~17 kernels per
layer (measured on an H100 before the projections were fused: 531 kernels per step for 30
layers, against 1,286 through the HF forward; `scripts/profile_engine_host.py --kernels`):

    rms_norm (1) | q, k, v projections as one GEMM (1) | [qwen3: q_norm, k_norm (2)] |
    rotary as one batched matmul per tensor (2) | K, V written into the cache (2) |
    SDPA over the KV heads, GQA without repeating K/V (1) + output to [B, Hq*D] (1) |
    o_proj fused with the residual add (1) | rms_norm (1) |
    gate and up as one GEMM (1) + act (1) + mul (1) | down_proj fused with the residual add (1)

i.e. ~14 per layer. The fused q/k/v and gate/up GEMMs read one buffer each whose row blocks ARE
the HF modules' parameters (`fuse_linears`): weight updates by name land in them unchanged.

It reads the modules' parameters at call time (in-place weight updates are seen, captured CUDA
graphs stay valid), allocates nothing but op outputs, never syncs with the host and has static
shapes per (batch, kv_len), so it runs inside CUDA graph capture and torch.compile. It never
calls the HF decoder layers: anything those would add (hooks, output recording) is skipped,
which is why `fast_decode_problem` only admits the structure it knows.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from verl_async.rollout.native.kv_cache import SlotKVCache

FAST_DECODE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
FAST_DECODE_ATTENTION = ("sdpa", "eager")

_ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def _norm_eps(norm: torch.nn.Module) -> Optional[float]:
    """The epsilon of an HF RMSNorm (`variance_epsilon` in llama/mistral/qwen2/qwen3, `eps` elsewhere)."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", None)
    return None if eps is None else float(eps)


def _norm_problem(norm: Optional[torch.nn.Module], name: str) -> Optional[str]:
    if norm is None:
        return f"no {name}"
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return f"{name} has no 1-D weight"
    if _norm_eps(norm) is None:
        return f"{name} has no variance_epsilon/eps"
    return None


def fast_decode_problem(model: torch.nn.Module, attention: tuple[str, ...] = FAST_DECODE_ATTENTION) -> Optional[str]:
    """None when `FastDecoder` computes exactly what this model's HF forward computes, else why not (one line).
    `attention`: the attention implementations the decoder stands in for (true on-policy mode: its own)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAST_DECODE_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {sorted(FAST_DECODE_MODEL_TYPES)}"
    if (getattr(config, "pretraining_tp", 1) or 1) != 1:
        return f"pretraining_tp={config.pretraining_tp} (sliced projections) is not supported"
    impl = getattr(config, "_attn_implementation", None)
    if impl not in attention:
        return f"attention implementation {impl!r} is not one of {attention}"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if getattr(inner, name, None) is None:
            return f"model.model.{name} is missing"
    if getattr(model, "lm_head", None) is None:
        return "model.lm_head is missing"
    problem = _norm_problem(inner.norm, "model.model.norm")
    if problem:
        return problem
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    num_layers = getattr(config, "num_hidden_layers", None)
    if not heads or not num_layers or heads % kv_heads:
        return f"unexpected head counts (heads {heads}, kv heads {kv_heads}) or layer count {num_layers}"
    layers = list(inner.layers)[:num_layers]
    if len(layers) != num_layers:
        return f"model.model.layers has {len(layers)} layers, config says {num_layers}"
    head_dim = None
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for owner, what, names in ((attn, "self_attn", _ATTN_LINEARS), (mlp, "mlp", _MLP_PARTS)):
            missing = [n for n in names if getattr(owner, n, None) is None]
            if missing:
                return f"layer {i}: {what} lacks {missing}"
        for name in ("input_layernorm", "post_attention_layernorm"):
            problem = _norm_problem(getattr(layer, name, None), f"layer {i} {name}")
            if problem:
                return problem
        if not isinstance(getattr(attn, "scaling", None), (int, float)) or not getattr(attn, "head_dim", None):
            return f"layer {i}: self_attn lacks a numeric `scaling` or `head_dim`"
        head_dim = head_dim or int(attn.head_dim)
        if int(attn.head_dim) != head_dim:
            return f"layer {i}: head_dim {attn.head_dim} differs from layer 0's {head_dim}"
        has_q, has_k = getattr(attn, "q_norm", None) is not None, getattr(attn, "k_norm", None) is not None
        if model_type == "qwen3" and not (has_q and has_k):
            return f"layer {i}: qwen3 self_attn lacks q_norm/k_norm"
        if has_q != has_k:
            return f"layer {i}: self_attn has only one of q_norm/k_norm"
        for name in ("q_norm", "k_norm") if has_q else ():
            problem = _norm_problem(getattr(attn, name), f"layer {i} {name}")
            if problem:
                return problem
    inv_freq = getattr(inner.rotary_emb, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or 2 * inv_freq.numel() != head_dim:
        # these families' apply_rotary_pos_emb rotates the whole head: a shorter table (partial_rotary_factor < 1)
        # is a configuration their HF forward does not support either
        rotary = None if not isinstance(inv_freq, torch.Tensor) else 2 * inv_freq.numel()
        return f"rotary dimension {rotary} is not head_dim {head_dim} (partial rotary is not supported)"
    return None


class _Layer(NamedTuple):
    """The modules of one decoder layer the fast step reads (parameters are read at call time)."""

    input_norm: torch.nn.Module
    post_norm: torch.nn.Module
    q_proj: torch.nn.Module
    k_proj: torch.nn.Module
    v_proj: torch.nn.Module
    o_proj: torch.nn.Module
    q_norm: Optional[torch.nn.Module]
    k_norm: Optional[torch.nn.Module]
    gate_proj: torch.nn.Module
    up_proj: torch.nn.Module
    down_proj: torch.nn.Module
    act_fn: torch.nn.Module
    scaling: float
    eps_in: float
    eps_post: float
    eps_qk: float
    qkv: Optional["FusedLinear"] = None  # q, k, v projections as one GEMM (their weights are views of it)
    gate_up: Optional["FusedLinear"] = None  # gate and up projections as one GEMM


class FusedLinear(NamedTuple):
    """One weight (and bias) buffer whose row blocks are the parameters of several Linear layers."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    sizes: list[int]


def _row_blocks_view(tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The one buffer `tensors` already are consecutive row blocks of (an earlier `fuse_linears`), else None.

    Why: a second FastDecoder on the same model must share the first one's buffer; fusing again would move the
    parameters to a new buffer and leave the first decoder reading weights that refits no longer reach.
    """
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())


def fuse_linears(linears: list[torch.nn.Module]) -> Optional[FusedLinear]:
    """Re-point the layers' parameters at row blocks of one new buffer, so that one GEMM serves them all.

    Why views: everything that writes weights by name (the engine's WeightLoader, `load_state_dict`,
    `param.copy_`) then writes into the fused buffer, whose address never changes (captured CUDA graphs
    stay valid), and the memory is the same as before (the separate tensors are freed). None, with the
    layers untouched, when they are not all plain Linear layers of one dtype, device and input width that
    all have, or all lack, a bias. Layers fused before (another FastDecoder on this model) keep their buffer.
    """
    if any(type(layer) is not torch.nn.Linear for layer in linears):
        return None
    weights = [layer.weight for layer in linears]
    w0 = weights[0]
    if any(w.dtype != w0.dtype or w.device != w0.device or w.shape[1:] != w0.shape[1:] for w in weights):
        return None  # torch.cat would promote or fail: leave such layers unfused
    with_bias = [layer.bias is not None for layer in linears]
    if any(with_bias) and not all(with_bias):
        return None
    biases = [layer.bias for layer in linears] if all(with_bias) else []
    if any(b.dtype != w0.dtype or b.device != w0.device for b in biases):
        return None
    sizes = [layer.out_features for layer in linears]
    weight = _row_blocks_view(weights)
    bias = _row_blocks_view(biases) if biases else None
    if weight is not None and (bias is not None or not biases):
        return FusedLinear(weight, bias, sizes)  # already fused: share that buffer
    # a normal tensor even when built under inference_mode: refits (`param.copy_`) must work outside it
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([w.detach() for w in weights])
        bias = torch.cat([b.detach() for b in biases]) if biases else None
        bias_views = bias.split(sizes) if bias is not None else [None] * len(linears)
        for layer, w_view, b_view in zip(linears, weight.split(sizes), bias_views):
            layer.weight = torch.nn.Parameter(w_view, requires_grad=False)
            if b_view is not None:
                layer.bias = torch.nn.Parameter(b_view, requires_grad=False)
    return FusedLinear(weight, bias, sizes)


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module, eps: float) -> torch.Tensor:
    """HF RMSNorm as one op (one fused kernel on CUDA); in bf16 it rounds once where HF rounds twice."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)


def _add_linear_(x: torch.Tensor, linear: torch.nn.Module, inp: torch.Tensor) -> torch.Tensor:
    """x += linear(inp), in place: one GEMM with beta=1 (residual add fused) for a plain bias-free Linear."""
    if type(linear) is torch.nn.Linear and linear.bias is None:
        return x.addmm_(inp, linear.weight.t())
    return x.add_(linear(inp))


def rotation_matrices(cos: torch.Tensor, sin: torch.Tensor, eye: torch.Tensor, swap: torch.Tensor) -> torch.Tensor:
    """Per-row RoPE as a [B, D, D] matrix R, so that x @ R == x * cos + rotate_half(x) * sin (HF's formula).

    cos, sin: [B, 1, D] (HF's rotary embedding of one position per row); eye: identity [D, D]; swap: the signed
    permutation of rotate_half (swap[j + D/2, j] = -1, swap[j, j + D/2] = 1). Built once per step; then each
    of q and k is rotated by one batched matmul instead of ~5 elementwise kernels.
    """
    return torch.addcmul(eye * cos, swap, sin)


def rotate_half_matrix(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(identity, signed rotate_half permutation) [D, D] for `rotation_matrices`: x @ swap == rotate_half(x)."""
    half = head_dim // 2
    eye = torch.eye(head_dim, dtype=dtype, device=device)
    swap = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
    idx = torch.arange(half, device=device)
    swap[idx + half, idx] = -1.0  # out[j] = -x[j + D/2] for j < D/2
    swap[idx, idx + half] = 1.0  # out[j + D/2] = x[j]
    return eye, swap


class FastDecoder:
    """One decode step (one new token per row) of a supported model, writing its K/V into a SlotKVCache.

    Row b of the batch is slot b; its new token goes to position positions[b] and it attends to keys
    [0, kv_len) of its slot under the additive (or bool) mask `decode_masks` built.
    """

    def __init__(self, model: torch.nn.Module, cache: SlotKVCache, layer_types: list[str], *,
                 fuse_projections: bool = True, attention: tuple[str, ...] = FAST_DECODE_ATTENTION) -> None:
        problem = fast_decode_problem(model, attention)
        if problem is not None:
            raise ValueError(f"fast decode: {problem}")
        config, inner = model.config, model.model
        self.cache = cache
        self.layer_types = list(layer_types)
        self.embed_tokens = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.norm, self.norm_eps = inner.norm, _norm_eps(inner.norm)
        self.lm_head = model.lm_head
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.groups = self.num_heads // self.num_kv_heads
        self.layers: list[_Layer] = []
        for layer in list(inner.layers)[: config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            q_norm = getattr(attn, "q_norm", None)
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm,
                    post_norm=layer.post_attention_layernorm,
                    q_proj=attn.q_proj,
                    k_proj=attn.k_proj,
                    v_proj=attn.v_proj,
                    o_proj=attn.o_proj,
                    q_norm=q_norm,
                    k_norm=getattr(attn, "k_norm", None),
                    gate_proj=mlp.gate_proj,
                    up_proj=mlp.up_proj,
                    down_proj=mlp.down_proj,
                    act_fn=mlp.act_fn,
                    scaling=float(attn.scaling),
                    eps_in=_norm_eps(layer.input_layernorm),
                    eps_post=_norm_eps(layer.post_attention_layernorm),
                    eps_qk=_norm_eps(q_norm) if q_norm is not None else 0.0,
                    qkv=fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]) if fuse_projections else None,
                    gate_up=fuse_linears([mlp.gate_proj, mlp.up_proj]) if fuse_projections else None,
                )
            )
        self.head_dim = int(inner.layers[0].self_attn.head_dim)  # equal in every layer (fast_decode_problem)
        k0 = cache.k[0]
        if len(self.layers) != len(cache.k) or k0.shape[1] != self.num_kv_heads or k0.shape[3] != self.head_dim:
            raise ValueError("fast decode: the KV cache does not match the model's layers / KV heads / head_dim")
        if len(self.layer_types) != len(self.layers):
            raise ValueError(f"fast decode: {len(self.layer_types)} layer types for {len(self.layers)} layers")
        weight = self.embed_tokens.weight
        self._eye, self._swap = rotate_half_matrix(self.head_dim, weight.dtype, weight.device)

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        masks: Union[torch.Tensor, dict[str, torch.Tensor]],
        kv_len: int,
    ) -> torch.Tensor:
        """[B] token ids at [B] positions -> [B, V] float32 logits; K/V of the new tokens land in the cache."""
        batch, heads, kv_heads, dim = ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        cache = self.cache
        rows = cache.rows[:batch]
        x = self.embed_tokens(ids)  # [B, hidden]; fresh, so the residual stream is updated in place below
        cos, sin = self.rotary_emb(x, positions[:, None])  # [B, 1, D], every rope_scaling type, once per step
        rot = rotation_matrices(cos, sin, self._eye, self._swap)  # [B, D, D]
        for i, layer in enumerate(self.layers):
            mask = masks[self.layer_types[i]] if isinstance(masks, dict) else masks
            h = _rms_norm(x, layer.input_norm, layer.eps_in)
            if layer.qkv is not None:  # one GEMM; q, k, v are column blocks (views) of its output
                q, k, v = F.linear(h, layer.qkv.weight, layer.qkv.bias).split(layer.qkv.sizes, dim=-1)
            else:
                q, k, v = layer.q_proj(h), layer.k_proj(h), layer.v_proj(h)
            q, k, v = q.view(batch, heads, dim), k.view(batch, kv_heads, dim), v.view(batch, kv_heads, dim)
            if layer.q_norm is not None:  # qwen3: RMSNorm over head_dim per head, before rotary
                q = _rms_norm(q, layer.q_norm, layer.eps_qk)
                k = _rms_norm(k, layer.k_norm, layer.eps_qk)
            q = torch.bmm(q, rot)
            k = torch.bmm(k, rot)
            k_cache, v_cache = cache.k[i], cache.v[i]
            k_cache[rows, :, positions] = k
            v_cache[rows, :, positions] = v
            # GQA without repeat_kv: the G query heads of a KV head are SDPA's "query length" for that head
            # (query head h reads KV head h // G, as repeat_kv does); the [B,1,1,L] mask broadcasts over both
            attn = F.scaled_dot_product_attention(
                q.view(batch, kv_heads, self.groups, dim),
                k_cache[:batch, :, :kv_len],
                v_cache[:batch, :, :kv_len],
                attn_mask=mask,
                scale=layer.scaling,
            )
            x = _add_linear_(x, layer.o_proj, attn.reshape(batch, heads * dim))
            h = _rms_norm(x, layer.post_norm, layer.eps_post)
            if layer.gate_up is not None:
                gate, up = F.linear(h, layer.gate_up.weight, layer.gate_up.bias).split(layer.gate_up.sizes, dim=-1)
            else:
                gate, up = layer.gate_proj(h), layer.up_proj(h)
            m = layer.act_fn(gate).mul_(up)
            x = _add_linear_(x, layer.down_proj, m)
        return self.lm_head(_rms_norm(x, self.norm, self.norm_eps)).float()

