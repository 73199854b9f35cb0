"""HF <-> Megatron-core weights for dense decoder LMs (Qwen2/Qwen2.5, Qwen3, Llama, Mistral).

Pure torch, no megatron import: every function here is tested on CPU with tiny
random tensors, because these layouts are where a silent error would hide.

Megatron's local layer spec names (per global layer i) and their HF sources:

    embedding.word_embeddings.weight                 model.embed_tokens.weight        vocab rows split over TP
    decoder.layers.i.input_layernorm.weight          ...layers.i.input_layernorm      replicated
    decoder.layers.i.self_attention.linear_qkv.*     ...self_attn.{q,k,v}_proj.*      per query group [q.., k, v]
    decoder.layers.i.self_attention.{q,k}_layernorm  ...self_attn.{q,k}_norm          replicated (Qwen3)
    decoder.layers.i.self_attention.linear_proj      ...self_attn.o_proj              input dim split over TP
    decoder.layers.i.pre_mlp_layernorm.weight        ...post_attention_layernorm      replicated
    decoder.layers.i.mlp.linear_fc1.weight           ...mlp.{gate,up}_proj            [gate_r; up_r] on TP rank r
    decoder.layers.i.mlp.linear_fc2.weight           ...mlp.down_proj                 input dim split over TP
    decoder.final_layernorm.weight                   model.norm.weight                replicated
    output_layer.weight                              lm_head.weight                   vocab rows split (absent when tied)

Two layouts need care. `linear_qkv` stores, for each of the `ng` query groups, that
group's query heads then its key head then its value head; TP ranks hold contiguous
groups, so the concatenated shards are the full tensor. `linear_fc1` (SwiGLU) holds
`[gate; up]` of ITS rows on every TP rank, so the concatenated shards interleave
`[g0; u0; g1; u1]` and must be split per rank. The vocabulary is padded with zero
rows to a multiple of the TP size; the trainer drops the padded logits.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

REPLICATED, COLUMN, ROW, VOCAB, QKV, GATE_UP = "replicated", "column", "row", "vocab", "qkv", "gate_up"
KINDS = (REPLICATED, COLUMN, ROW, VOCAB, QKV, GATE_UP)

# HF architecture -> family; a family fixes which optional tensors exist.
ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
}
# Llama 3.1 RoPE scaling as megatron-core implements it (only `factor` is a parameter there).
_MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class ConversionError(ValueError):
    """The HF model (or a tensor) does not fit the Megatron layout; the message names it."""


@dataclass(frozen=True)
class ModelSpec:
    """What Megatron needs to know about an HF dense decoder."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    rope_scaling_factor: Optional[float] = None  # Llama 3.1 style scaling

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope(config: Any) -> tuple[float, Optional[dict]]:
    """(theta, scaling dict or None) from transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    theta = getattr(config, "rope_theta", None) or params.get("rope_theta") or scaling.get("rope_theta") or 10000.0
    merged = {**scaling, **params}
    kind = merged.get("rope_type") or merged.get("type") or "default"
    return float(theta), (None if kind == "default" else merged)


def model_spec(config: Any) -> ModelSpec:
    """Read an HF config; refuse what the Megatron local spec cannot reproduce exactly."""
    archs = list(getattr(config, "architectures", None) or [])
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        model_type = getattr(config, "model_type", "")
        arch = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama", "mistral": "llama"}.get(model_type)
    if arch is None:
        raise ConversionError(
            f"actor_rollout_ref.model.path: architecture {archs or getattr(config, 'model_type', '?')} is not "
            f"supported by the Megatron backend (supported: {sorted(ARCHITECTURES)}); use "
            f"actor_rollout_ref.actor.strategy=fsdp2"
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"hidden_act={act!r}: the Megatron backend converts SwiGLU (silu) MLPs only")
    if getattr(config, "mlp_bias", False):
        raise ConversionError("mlp_bias=True has no Megatron local-spec equivalent (add_bias_linear also biases "
                              "the attention output)")
    if arch == "qwen2":
        qkv_bias = True  # Qwen2 attention always has q/k/v biases and none on o_proj
        if getattr(config, "use_sliding_window", False):
            raise ConversionError("use_sliding_window=True is not supported by the Megatron backend")
    else:
        qkv_bias = bool(getattr(config, "attention_bias", False))
        if qkv_bias and arch == "llama":
            raise ConversionError("attention_bias=True (o_proj bias too) has no Megatron local-spec equivalent")
    window = getattr(config, "sliding_window", None)
    if arch == "llama" and window is not None and window < config.max_position_embeddings:
        raise ConversionError(f"sliding_window={window} is not supported by the Megatron backend")
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if heads % kv:
        raise ConversionError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    theta, scaling = _rope(config)
    factor = None
    if scaling is not None:
        if scaling.get("rope_type", scaling.get("type")) != "llama3":
            raise ConversionError(f"rope scaling {scaling} is not supported by the Megatron backend (llama3 only)")
        for key, value in _MCORE_LLAMA3_ROPE.items():
            if key in scaling and float(scaling[key]) != value:
                raise ConversionError(f"llama3 rope scaling with {key}={scaling[key]}: megatron-core fixes it to {value}")
        factor = float(scaling["factor"])
    return ModelSpec(
        arch=arch, num_layers=int(config.num_hidden_layers), hidden_size=int(config.hidden_size), num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, ffn_hidden_size=int(config.intermediate_size),
        vocab_size=int(config.vocab_size), max_position_embeddings=int(config.max_position_embeddings),
        rms_norm_eps=float(config.rms_norm_eps), rope_theta=theta, qkv_bias=qkv_bias, qk_norm=arch == "qwen3",
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)), rope_scaling_factor=factor,
    )


def check_parallel(spec: ModelSpec, tp: int, pp: int) -> None:
    """Divisibility Megatron needs; errors name the megatron key."""
    key = "actor_rollout_ref.actor.megatron"
    for what, n in (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads),
                    ("intermediate_size", spec.ffn_hidden_size)):
        if n % tp:
            raise ConversionError(f"{key}.tensor_model_parallel_size={tp} does not divide the model's {what}={n}")
    if spec.num_layers % pp:
        raise ConversionError(f"{key}.pipeline_model_parallel_size={pp} does not divide the model's "
                              f"num_hidden_layers={spec.num_layers}")


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    return int(math.ceil(vocab_size / tp) * tp)


def transformer_config_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """TransformerConfig fields that describe the architecture (the HF config owns them)."""
    return dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
    )


# TransformerConfig fields the HF config owns (an override of one is refused: it would break the weights).
ARCHITECTURE_KEYS = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
    "add_qkv_bias", "qk_layernorm", "hidden_dropout", "attention_dropout",
})


def gpt_model_kwargs(spec: ModelSpec, tp: int) -> dict[str, Any]:
    """GPTModel constructor arguments besides config / layer spec / pipeline stage flags."""
    kwargs: dict[str, Any] = dict(
        vocab_size=padded_vocab_size(spec.vocab_size, tp), max_sequence_length=spec.max_position_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=spec.rope_theta,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
    )
    if spec.rope_scaling_factor is not None:
        kwargs.update(rope_scaling=True, rope_scaling_factor=spec.rope_scaling_factor)
    return kwargs


# ------------------------------------------------------------------ names
@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter (global layer numbering) and the HF tensors it is made of."""

    mcore: str
    hf: tuple[str, ...]
    kind: str


def layer_param_maps(spec: ModelSpec, layer: int) -> list[ParamMap]:
    m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    attn = h + "self_attn."
    maps = [
        ParamMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",), REPLICATED),
        ParamMap(m + "self_attention.linear_qkv.weight",
                 tuple(attn + f"{p}_proj.weight" for p in "qkv"), QKV),
    ]
    if spec.qkv_bias:
        maps.append(ParamMap(m + "self_attention.linear_qkv.bias", tuple(attn + f"{p}_proj.bias" for p in "qkv"), QKV))
    if spec.qk_norm:
        maps += [ParamMap(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), REPLICATED),
                 ParamMap(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), REPLICATED)]
    maps += [
        ParamMap(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), ROW),
        ParamMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), REPLICATED),
        ParamMap(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), GATE_UP),
        ParamMap(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), ROW),
    ]
    return maps


def param_maps(spec: ModelSpec) -> list[ParamMap]:
    """Every parameter of the full model, in HF order (embedding, layers, norm, head)."""
    maps = [ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB)]
    for layer in range(spec.num_layers):
        maps += layer_param_maps(spec, layer)
    maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED))
    if not spec.tie_word_embeddings:
        maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), VOCAB))
    return maps


def param_map_for(spec: ModelSpec, mcore_name: str) -> ParamMap:
    """The map of one global Megatron name; the untied-copy `output_layer.weight` of a tied model
    (the last pipeline stage keeps one) maps to the embedding."""
    if mcore_name == "output_layer.weight" and spec.tie_word_embeddings:
        return ParamMap(mcore_name, ("model.embed_tokens.weight",), VOCAB)
    if mcore_name.startswith("decoder.layers."):
        layer = int(mcore_name.split(".")[2])
        found = [p for p in layer_param_maps(spec, layer) if p.mcore == mcore_name]
    else:
        found = [p for p in param_maps(spec) if p.mcore == mcore_name and not p.mcore.startswith("decoder.layers.")]
    if not found:
        raise ConversionError(f"no HF source for Megatron parameter {mcore_name!r} ({spec.arch})")
    return found[0]


def hf_names(spec: ModelSpec) -> list[str]:
    """HF parameter names of the full model, as the HF module's `named_parameters()` lists them."""
    return [name for pm in param_maps(spec) for name in pm.hf]


# ------------------------------------------------------------------ tensors
def _check_shape(name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ConversionError(f"HF tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def _qkv_full(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    ng, hd, hpg = spec.num_kv_heads, spec.head_dim, spec.heads_per_group
    tail = q.shape[1:]
    parts = (q.reshape(ng, hpg * hd, *tail), k.reshape(ng, hd, *tail), v.reshape(ng, hd, *tail))
    return torch.cat(parts, dim=1).reshape(ng * (hpg + 2) * hd, *tail)


def _qkv_split(spec: ModelSpec, full: torch.Tensor) -> list[torch.Tensor]:
    ng, hd, hpg = spec.num_kv_heads, spec.head_dim, spec.heads_per_group
    tail = full.shape[1:]
    q, k, v = full.reshape(ng, (hpg + 2) * hd, *tail).split([hpg * hd, hd, hd], dim=1)
    return [q.reshape(ng * hpg * hd, *tail), k.reshape(ng * hd, *tail), v.reshape(ng * hd, *tail)]


def expected_hf_shapes(spec: ModelSpec, pm: ParamMap) -> list[tuple[int, ...]]:
    h, hd = spec.hidden_size, spec.head_dim
    if pm.kind == QKV:
        rows = [spec.num_heads * hd, spec.num_kv_heads * hd, spec.num_kv_heads * hd]
        return [(r, h) if pm.mcore.endswith("weight") else (r,) for r in rows]
    if pm.kind == GATE_UP:
        return [(spec.ffn_hidden_size, h)] * 2
    if pm.kind == VOCAB:
        return [(spec.vocab_size, h)]
    if pm.mcore.endswith("linear_proj.weight"):
        return [(h, spec.num_heads * hd)]
    if pm.mcore.endswith("linear_fc2.weight"):
        return [(h, spec.ffn_hidden_size)]
    if "q_layernorm" in pm.mcore or "k_layernorm" in pm.mcore:
        return [(hd,)]
    return [(h,)]


def to_mcore_shard(spec: ModelSpec, pm: ParamMap, hf: Sequence[torch.Tensor], tp_rank: int, tp_size: int) -> torch.Tensor:
    """The TP shard of rank `tp_rank` of a Megatron parameter, from its HF tensors (in `pm.hf` order)."""
    if len(hf) != len(pm.hf):
        raise ConversionError(f"{pm.mcore}: expected {len(pm.hf)} HF tensors {pm.hf}, got {len(hf)}")
    for name, t, shape in zip(pm.hf, hf, expected_hf_shapes(spec, pm)):
        _check_shape(name, t, shape)
    if pm.kind == REPLICATED:
        return hf[0]
    if pm.kind == COLUMN:
        return hf[0].chunk(tp_size, dim=0)[tp_rank]
    if pm.kind == ROW:
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if pm.kind == VOCAB:
        rows = padded_vocab_size(spec.vocab_size, tp_size)
        full = hf[0]
        if rows > full.shape[0]:
            full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
        return full.chunk(tp_size, dim=0)[tp_rank]
    if pm.kind == QKV:
        return _qkv_full(spec, *hf).chunk(tp_size, dim=0)[tp_rank]
    if pm.kind == GATE_UP:
        gate, up = hf
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
    raise ConversionError(f"{pm.mcore}: unknown kind {pm.kind!r}")


def from_mcore_shards(spec: ModelSpec, pm: ParamMap, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """HF tensors (in `pm.hf` order) from all TP shards of a Megatron parameter (rank order)."""
    if pm.kind == REPLICATED:
        return [shards[0]]
    if pm.kind == COLUMN:
        return [torch.cat(list(shards), dim=0)]
    if pm.kind == ROW:
        return [torch.cat(list(shards), dim=1)]
    if pm.kind == VOCAB:
        return [torch.cat(list(shards), dim=0)[: spec.vocab_size]]
    if pm.kind == QKV:
        return _qkv_split(spec, torch.cat(list(shards), dim=0))
    if pm.kind == GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])]
    raise ConversionError(f"{pm.mcore}: unknown kind {pm.kind!r}")


# ------------------------------------------------------------------ HF checkpoint reading
class HFCheckpoint:
    """Read single tensors of an HF folder lazily (safetensors, sharded or not; .bin as a fallback).

    Every rank reads only the tensors of its own pipeline stage and TP shard source,
    so no rank ever holds the whole model in host memory (safetensors files are mmapped).
    """

    def __init__(self, path: str):
        self.path = path
        self._where: dict[str, str] = {}
        self._bin: Optional[dict[str, torch.Tensor]] = None
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                self._where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.exists(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self._where = {k: single for k in f.keys()}
        else:
            bins = sorted(n for n in os.listdir(path) if n.startswith("pytorch_model") and n.endswith(".bin"))
            if not bins:
                raise FileNotFoundError(f"actor_rollout_ref.model.path={path!r}: no model.safetensors(.index.json) or "
                                        f"pytorch_model*.bin to load weights from")
            self._bin = {}
            for name in bins:
                self._bin.update(torch.load(os.path.join(path, name), map_location="cpu", weights_only=True))
            self._where = {k: "" for k in self._bin}
        self._handles: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ConversionError(f"HF checkpoint {self.path!r} has no tensor {name!r}")
        if self._bin is not None:
            return self._bin[name]
        from safetensors import safe_open

        file = self._where[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()
        self._bin = None


def unexpected_hf_tensors(spec: ModelSpec, names: Iterable[str]) -> list[str]:
    """Checkpoint tensors the conversion would ignore (a tied `lm_head.weight` and rotary buffers are fine)."""
    known = set(hf_names(spec))
    ignorable = {"lm_head.weight"} if spec.tie_word_embeddings else set()
    return sorted(n for n in names if n not in known and n not in ignorable and "rotary_emb" not in n)


def hf_tensors_from_megatron(spec: ModelSpec, full: Mapping[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{HF name: tensor} from {global Megatron name: TP shards}; used by tests and the exporter."""
    out: dict[str, torch.Tensor] = {}
    for pm in param_maps(spec):
        for name, t in zip(pm.hf, from_mcore_shards(spec, pm, full[pm.mcore])):
            out[name] = t
    return out
