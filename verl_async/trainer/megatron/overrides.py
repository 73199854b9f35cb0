"""`override_transformer_config.*` and `optim.override_optimizer_config.*` -> megatron-core configs.

verl launch scripts (the Ascend one in docs/) turn on fusions by name:
`+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True`.
Here every key is checked against the dataclass it goes to:

* unknown key -> error naming it (and close spellings);
* a key the HF config or another verl key owns (`num_layers`, `tensor_model_parallel_size`,
  `bf16`, `lr`, ...) -> error naming the key to use instead;
* a fusion whose kernel this machine lacks -> turned off, and a note says which
  kernel was missing and what runs instead (the result is numerically the same op,
  unfused). The reference script's fusions then start on a plain CUDA machine
  (no Transformer Engine / apex) as well as on Ascend with MindSpeed, where MindSpeed
  supplies the NPU kernels and its own fields (e.g. `use_flash_attn`), so the keys are
  passed through untouched.

Pure functions of (overrides, known fields, `Platform`); `probe_platform()` is the
only part that looks at the installed packages.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from verl_async.trainer.megatron.convert import ARCHITECTURE_KEYS

TC_KEY = "actor_rollout_ref.actor.megatron.override_transformer_config"
OPT_KEY = "actor_rollout_ref.actor.optim.override_optimizer_config"

# TransformerConfig fields set from verl keys (not through overrides).
_TC_OWNED = {
    "tensor_model_parallel_size": "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size": "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size",
    "context_parallel_size": "actor_rollout_ref.actor.megatron.context_parallel_size",
    "expert_model_parallel_size": "actor_rollout_ref.actor.megatron.expert_model_parallel_size",
    "expert_tensor_parallel_size": "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size",
    "sequence_parallel": "actor_rollout_ref.actor.megatron.sequence_parallel",
    "params_dtype": "actor_rollout_ref.actor.megatron.dtype",
    "pipeline_dtype": "actor_rollout_ref.actor.megatron.dtype",
    "bf16": "actor_rollout_ref.actor.megatron.dtype",
    "fp16": "actor_rollout_ref.actor.megatron.dtype",
}
_OPT_OWNED = {
    "optimizer": "actor_rollout_ref.actor.optim.optimizer",
    "lr": "actor_rollout_ref.actor.optim.lr",
    "min_lr": "actor_rollout_ref.actor.optim.min_lr",
    "weight_decay": "actor_rollout_ref.actor.optim.weight_decay",
    "adam_beta1": "actor_rollout_ref.actor.optim.betas",
    "adam_beta2": "actor_rollout_ref.actor.optim.betas",
    "adam_eps": "actor_rollout_ref.actor.optim.eps",
    "clip_grad": "actor_rollout_ref.actor.grad_clip",
    "bf16": "actor_rollout_ref.actor.megatron.dtype",
    "fp16": "actor_rollout_ref.actor.megatron.dtype",
    "params_dtype": "actor_rollout_ref.actor.megatron.dtype",
    "use_distributed_optimizer": "actor_rollout_ref.actor.megatron.use_distributed_optimizer",
}
# Keys verl scripts pass that stock megatron-core's TransformerConfig lacks (MindSpeed adds them).
_TC_COMPAT = {"use_flash_attn"}


@dataclass(frozen=True)
class Platform:
    """What is installed next to megatron-core (decides which fusions can run)."""

    device: str  # cuda | npu | cpu
    transformer_engine: bool = False
    apex: bool = False  # apex.normalization (FusedLayerNorm / FusedRMSNorm): sequence parallel norms
    fused_softmax: bool = False  # scaled_(upper_triang_)masked_softmax_cuda kernels
    grad_accum_fusion: bool = False  # fused_weight_gradient_mlp_cuda
    rope_fusion: bool = False  # megatron's fused_apply_rotary_pos_emb (Transformer Engine)
    fused_adam: bool = False  # TE or apex FusedAdam (precision-aware / CPU-offload optimizer)
    mindspeed: bool = False  # Ascend: MindSpeed patches megatron-core with NPU kernels


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def probe_platform(device: str) -> Platform:
    """Look at the installed kernels (call after megatron-core is importable)."""
    te = _has("transformer_engine")
    rope = False
    try:
        from megatron.core.models.common.embeddings import rope_utils

        rope = getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None
    except ImportError:
        pass
    gpu = device == "cuda"
    return Platform(
        device=device, transformer_engine=te and gpu, apex=_has("apex.normalization") and gpu,
        fused_softmax=gpu and _has("scaled_upper_triang_masked_softmax_cuda") and _has("scaled_masked_softmax_cuda"),
        grad_accum_fusion=gpu and (_has("fused_weight_gradient_mlp_cuda") or te), rope_fusion=rope and gpu,
        fused_adam=gpu and (te or _has("apex.optimizers")), mindspeed=device == "npu" and _has("mindspeed"),
    )


# key -> (can it run here?, what was missing, what runs instead)
Requirement = tuple[Callable[[Platform], bool], str, str]
_TC_REQUIRES: dict[str, Requirement] = {
    "apply_rope_fusion": (lambda p: p.rope_fusion, "Transformer Engine's fused RoPE kernel",
                          "RoPE is applied by the unfused PyTorch code"),
    "masked_softmax_fusion": (lambda p: p.fused_softmax, "scaled_masked_softmax_cuda kernels (apex / megatron "
                              "fused kernels)", "attention softmax runs in PyTorch (fp32)"),
    "gradient_accumulation_fusion": (lambda p: p.grad_accum_fusion, "fused_weight_gradient_mlp_cuda (apex) or "
                                     "Transformer Engine", "weight gradients use a plain matmul"),
    "persist_layer_norm": (lambda p: p.apex, "apex's persistent LayerNorm kernel",
                           "the PyTorch norm runs (this model uses RMSNorm either way)"),
    "use_flash_attn": (lambda p: False, "use_flash_attn field in megatron-core's TransformerConfig (MindSpeed adds it "
                       "on Ascend; megatron-core's own flash attention needs Transformer Engine)", "megatron-core's local DotProductAttention runs"),
}
_OPT_REQUIRES: dict[str, Requirement] = {
    "use_precision_aware_optimizer": (lambda p: p.transformer_engine, "Transformer Engine's FusedAdam",
                                      "the fp32 main-parameter optimizer runs"),
    "optimizer_cpu_offload": (lambda p: p.fused_adam, "FusedAdam (Transformer Engine or apex) for the device "
                              "part of megatron's HybridDeviceOptimizer",
                              "the optimizer stays on the device; actor_rollout_ref.actor.megatron."
                              "optimizer_offload=True moves its state to the host between updates instead"),
}
# Optimizer keys that only mean something with optimizer_cpu_offload.
_OPT_DEPENDENT = {"optimizer_offload_fraction": "optimizer_cpu_offload",
                  "overlap_cpu_optimizer_d2h_h2d": "optimizer_cpu_offload",
                  "pin_cpu_grads": "optimizer_cpu_offload", "pin_cpu_params": "optimizer_cpu_offload"}


def _unknown(key: str, prefix: str, fields: set[str], where: str) -> ValueError:
    close = difflib.get_close_matches(key, sorted(fields), n=3)
    hint = f"; did you mean {close}?" if close else ""
    return ValueError(f"{prefix}.{key}: unknown key, {where} has no field {key!r}{hint}")


def _apply(overrides: Mapping[str, Any], *, prefix: str, fields: set[str], owned: Mapping[str, str],
           requires: Mapping[str, Requirement], platform: Platform, where: str, compat: set[str] = frozenset()
           ) -> tuple[dict[str, Any], list[str]]:
    kwargs: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in overrides.items():
        if key in owned:
            raise ValueError(f"{prefix}.{key}: set by {owned[key]}, not through overrides")
        if key not in fields and key not in compat:
            raise _unknown(key, prefix, fields, where)
        if platform.mindspeed:  # Ascend + MindSpeed: its kernels, its fields, its checks
            if key in fields:
                kwargs[key] = value
            continue
        if key in requires and value:
            ok, missing, instead = requires[key]
            if not ok(platform):
                notes.append(f"{prefix}.{key}=True turned off: no {missing} on this "
                             f"{platform.device} machine; {instead}")
                continue
        if key in fields:
            kwargs[key] = value
    return kwargs, notes


def transformer_overrides(overrides: Mapping[str, Any], fields: set[str], platform: Platform
                          ) -> tuple[dict[str, Any], list[str]]:
    """(TransformerConfig kwargs, notes) from `override_transformer_config`; see the module docstring."""
    for key in overrides:
        if key in ARCHITECTURE_KEYS:
            raise ValueError(f"{TC_KEY}.{key}: set from the HF config of actor_rollout_ref.model.path (change the "
                             f"model with actor_rollout_ref.model.override_config instead)")
    return _apply(overrides, prefix=TC_KEY, fields=fields, owned=_TC_OWNED, requires=_TC_REQUIRES,
                  platform=platform, where="megatron-core's TransformerConfig", compat=_TC_COMPAT)


def optimizer_overrides(overrides: Mapping[str, Any], fields: set[str], platform: Platform
                        ) -> tuple[dict[str, Any], list[str]]:
    """(OptimizerConfig kwargs, notes) from `optim.override_optimizer_config`."""
    kwargs, notes = _apply(overrides, prefix=OPT_KEY, fields=fields, owned=_OPT_OWNED, requires=_OPT_REQUIRES,
                           platform=platform, where="megatron-core's OptimizerConfig")
    for key, needs in _OPT_DEPENDENT.items():
        if key in kwargs and not kwargs.get(needs, False):
            kwargs.pop(key)
            if overrides.get(needs):
                notes.append(f"{OPT_KEY}.{key} dropped with {needs}")
    return kwargs, notes


def sequence_parallel_allowed(requested: bool, tp: int, platform: Platform) -> tuple[bool, Optional[str]]:
    """Sequence parallelism needs TP > 1 and a norm that supports it.

    The local layer spec builds RMSNorm as megatron-core's WrappedTorchNorm, which refuses
    sequence parallelism; MindSpeed (Ascend) replaces it with a fused norm that supports it.
    """
    if not requested or tp == 1:
        return False, None
    if platform.mindspeed:
        return True, None
    return False, ("actor_rollout_ref.actor.megatron.sequence_parallel=True turned off: the local layer spec's "
                   "RMSNorm (torch) does not support sequence parallelism; activations are replicated over the "
                   "TP ranks instead (same numbers, more activation memory)")
