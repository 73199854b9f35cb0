"""Turn a loaded HF causal LM into its batch-invariant twin, in place (engine and trainer call the same).

The model's own modules stay (FSDP2 shards and hooks them, autograd runs through them, the
engine's KV cache plugs into them, checkpoints see the same names): each `nn.Linear` and RMSNorm
gets a forward from `ops`, the MLP's SiLU is replaced by `ops.silu`, and attention switches to
`attention.ATTENTION_NAME` with the model's span (the longest prompt + response) set on every
attention module. Embedding lookups, residual adds, rotary (a product, a cos and a sin per
element) are exact or per-element already and stay as they are.

Only the families the README names are admitted (llama, mistral, qwen2, qwen3: RMSNorm, SwiGLU,
RoPE), checked by `invariant_problem`; anything else is refused by name rather than made
"almost" invariant.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from verl_async.invariant import attention, exact
from verl_async.invariant.ops import linear, rms_norm, silu
from verl_async.invariant.shapes import shapes_for

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SPAN_MULTIPLE = 64


def attention_span(max_model_len: int) -> int:
    """Key slots every query attends over: the longest sequence rounded up to 64 (engine slot length = this)."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    return -(-int(max_model_len) // SPAN_MULTIPLE) * SPAN_MULTIPLE


def invariant_problem(model: torch.nn.Module, span: Optional[int] = None) -> Optional[str]:
    """Why `make_invariant` cannot serve this model (with attention over `span` keys), or None."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(text, "model_type", None)
    if kind not in MODEL_TYPES:
        return f"model type {kind!r} is not one of {MODEL_TYPES}"
    act = getattr(text, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        return f"hidden_act {act!r} is not silu"
    if float(getattr(text, "attention_dropout", 0.0) or 0.0) != 0.0:
        return "attention_dropout is not 0"
    for name, buf in model.named_buffers():
        if name.endswith("inv_freq") and buf.dtype != torch.float32:
            return f"rotary buffer {name} is {buf.dtype}, not float32"
    heads = getattr(text, "num_attention_heads", 1)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    lengths = {"hidden_size": text.hidden_size, "intermediate_size": getattr(text, "intermediate_size", 1),
               "num_attention_heads * head_dim": heads * head_dim}
    if span is not None:
        lengths["the attention span (prompt + response length)"] = int(span)
    return exact.length_problem(lengths)


GRID_ATTR = "_true_on_policy_grid"  # (weight identity, exact.WeightGrid) on a Linear whose owner keeps grids


def _weight_grid(module: torch.nn.Linear) -> Optional[exact.WeightGrid]:
    """The weight's exact grid, kept on the module while the weight's storage and version counter are unchanged
    (an in-place refit such as the engine's `param.copy_` bumps the counter); None where not kept."""
    cached = getattr(module, GRID_ATTR, None)
    if cached is None or module.weight.device.type != "cpu":
        return None
    w = module.weight
    key = (w.data_ptr(), w._version, tuple(w.shape), w.dtype)
    if cached[0] != key:
        cached = (key, exact.weight_grid(w))
        setattr(module, GRID_ATTR, cached)
    return cached[1]


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias, shapes_for(x.device).linear_rows, _weight_grid(self))


def _norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(self, "variance_epsilon", None)
    return rms_norm(x, self.weight, float(self.eps if eps is None else eps), shapes_for(x.device).reduce_rows)


class InvariantSiLU(torch.nn.Module):
    """The MLP's activation (`ops.silu`); no parameters, so state dicts are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x)


def _is_rms_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)


def make_invariant(model: torch.nn.Module, span: int, *, keep_weight_grids: bool = False) -> torch.nn.Module:
    """Patch `model` in place (see the module docstring); `span` from `attention_span`. Returns the model.

    `keep_weight_grids` (the engine, whose weights change only by refits): each CPU linear keeps its weight's
    exact grid (float64, twice the float32 weight's memory) instead of rebuilding it every call."""
    problem = invariant_problem(model, span)
    if problem is not None:
        raise ValueError(f"actor_rollout_ref.rollout.true_on_policy: {problem}")
    name = attention.register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # transformers 4.x
        model.config._attn_implementation = name
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_linear_forward, module)
            if keep_weight_grids:
                setattr(module, GRID_ATTR, (None, None))
        elif _is_rms_norm(module):
            module.forward = types.MethodType(_norm_forward, module)
        if isinstance(getattr(module, "act_fn", None), torch.nn.Module) and hasattr(module, "down_proj"):
            module.act_fn = InvariantSiLU()
        if hasattr(module, "o_proj") and hasattr(module, "layer_idx"):
            setattr(module, attention.SPAN_ATTR, int(span))
    model._true_on_policy_span = int(span)
    return model
