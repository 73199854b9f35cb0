"""The Megatron trainer's own keys (`actor_rollout_ref.{actor,ref}.megatron.*`, Megatron optimizer keys).

Everything else (losses, batch sizes, log-prob micro-batching, checkpoint rotation)
is `TrainerSettings`, shared with FSDP2. Parsed once from the resolved config; what
this backend does not support fails here with the key in the message, before any
process group exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from verl_async.trainer.settings import TrainerSettings, _get

_A = "actor_rollout_ref.actor"
_DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                "fp32": "float32", "float32": "float32"}
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
             "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size")


@dataclass(frozen=True)
class MegatronSettings:
    tp: int
    pp: int
    cp: int
    ep: int
    sequence_parallel: bool
    use_distributed_optimizer: bool
    param_offload: bool
    grad_offload: bool
    optimizer_offload: bool
    ref_param_offload: bool
    seed: int
    dtype: str  # compute/parameter dtype on accelerators (CPU always runs float32)
    override_transformer_config: dict = field(default_factory=dict)
    override_optimizer_config: dict = field(default_factory=dict)
    recompute: bool = False  # actor_rollout_ref.model.enable_gradient_checkpointing
    # Megatron's OptimizerParamScheduler
    optimizer: str = "adam"
    lr_decay_style: str = "constant"
    lr_decay_steps: Optional[int] = None
    lr_warmup_init: float = 0.0
    min_lr: float = 0.0
    weight_decay_incr_style: str = "constant"
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_steps: Optional[int] = None

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], trainer: TrainerSettings) -> "MegatronSettings":
        g = lambda path, default=dataclasses.MISSING: _get(cfg, path, default)  # noqa: E731
        m = f"{_A}.megatron"
        if g(f"{_A}.strategy", "megatron") != "megatron":
            raise ValueError(f"{_A}.strategy must be megatron for the Megatron worker group, got {g(f'{_A}.strategy')!r}")
        sizes = {k: g(f"{m}.{k}", None) for k in _PARALLEL}
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                    "expert_model_parallel_size"):
            if sizes[key] is None:
                sizes[key] = 1
            if isinstance(sizes[key], bool) or int(sizes[key]) != sizes[key] or sizes[key] < 1:
                raise ValueError(f"{m}.{key} must be a positive integer, got {sizes[key]!r}")
        vpp, etp = sizes["virtual_pipeline_model_parallel_size"], sizes["expert_tensor_parallel_size"]
        if vpp not in (None, 1):
            raise ValueError(f"{m}.virtual_pipeline_model_parallel_size={vpp}: the interleaved (virtual) pipeline "
                             f"schedule is not supported by verl_async's Megatron backend; use null")
        if sizes["context_parallel_size"] > 1:
            raise ValueError(f"{m}.context_parallel_size={sizes['context_parallel_size']}: context parallelism needs "
                             f"Transformer Engine attention, and verl_async's Megatron backend builds the local "
                             f"(non-TE) layer spec; use 1")
        if sizes["expert_model_parallel_size"] > 1 or etp not in (None, 1):
            raise ValueError(f"{m}.expert_model_parallel_size={sizes['expert_model_parallel_size']} / "
                             f"expert_tensor_parallel_size={etp}: verl_async converts dense models only "
                             f"(Qwen2/Qwen2.5/Qwen3/Llama/Mistral), which have no experts; use 1 / null")
        ref = "actor_rollout_ref.ref.megatron"
        for key in _PARALLEL:
            ref_value = g(f"{ref}.{key}", sizes[key])
            if ref_value != sizes[key] and not (key in ("virtual_pipeline_model_parallel_size",
                                                        "expert_tensor_parallel_size") and ref_value in (None, 1)
                                                and sizes[key] in (None, 1)):
                raise ValueError(f"{ref}.{key}={ref_value} differs from {m}.{key}={sizes[key]}: the reference "
                                 f"model lives in the actor's processes and shares its parallel layout")
        dtype = g(f"{m}.dtype", "bfloat16")
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"{m}.dtype must be one of {sorted(_DTYPE_NAMES)}, got {dtype!r}")
        tp, pp, cp = (int(sizes[k]) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                              "context_parallel_size"))
        if trainer.world_size % (tp * pp * cp):
            raise ValueError(f"{m}.tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size "
                             f"= {tp * pp * cp} does not divide the trainer's {trainer.world_size} devices")
        style = g(f"{_A}.optim.lr_decay_style", "constant")
        if style not in LR_DECAY_STYLES:
            raise ValueError(f"{_A}.optim.lr_decay_style must be one of {LR_DECAY_STYLES}, got {style!r}")
        optimizer = g(f"{_A}.optim.optimizer", "adam")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"{_A}.optim.optimizer must be adam or sgd, got {optimizer!r}")
        decay_steps = g(f"{_A}.optim.lr_decay_steps", None)
        return cls(
            tp=tp, pp=pp, cp=cp, ep=int(sizes["expert_model_parallel_size"]),
            sequence_parallel=bool(g(f"{m}.sequence_parallel", False)) and tp > 1,
            use_distributed_optimizer=bool(g(f"{m}.use_distributed_optimizer", True)),
            param_offload=bool(g(f"{m}.param_offload", False)),
            grad_offload=bool(g(f"{m}.grad_offload", False)),
            optimizer_offload=bool(g(f"{m}.optimizer_offload", False)),
            ref_param_offload=bool(g(f"{ref}.param_offload", False)),
            seed=int(g(f"{m}.seed", 42)),
            dtype=_DTYPE_NAMES[dtype],
            override_transformer_config=dict(g(f"{m}.override_transformer_config", {}) or {}),
            override_optimizer_config=dict(g(f"{_A}.optim.override_optimizer_config", {}) or {}),
            recompute=bool(g("actor_rollout_ref.model.enable_gradient_checkpointing", False)),
            optimizer=optimizer,
            lr_decay_style=style,
            lr_decay_steps=None if decay_steps in (None, -1) else int(decay_steps),
            lr_warmup_init=float(g(f"{_A}.optim.lr_warmup_init", 0.0) or 0.0),
            min_lr=float(g(f"{_A}.optim.min_lr", 0.0) or 0.0),
            weight_decay_incr_style=str(g(f"{_A}.optim.weight_decay_incr_style", "constant")),
            lr_wsd_decay_style=str(g(f"{_A}.optim.lr_wsd_decay_style", "exponential")),
            lr_wsd_decay_steps=g(f"{_A}.optim.lr_wsd_decay_steps", None),
        )

    def layout(self, dp_size: int) -> dict[str, Any]:
        """What a checkpoint's shards depend on (written to meta.json; loading needs the same)."""
        return {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
                "data_parallel_size": dp_size, "use_distributed_optimizer": self.use_distributed_optimizer}

    def check_checkpoint(self, path: str, meta: Mapping[str, Any], dp_size: int) -> None:
        if meta.get("backend") != "megatron" or meta.get("layout") != self.layout(dp_size):
            raise ValueError(f"checkpoint {path!r} was written by backend {meta.get('backend', 'fsdp')} with layout "
                             f"{meta.get('layout')}; this run is megatron {self.layout(dp_size)}. Resume with the "
                             f"same layout, or export_hf() it and start from that HF folder "
                             f"(actor_rollout_ref.model.path)")

    def scheduler_steps(self, trainer: TrainerSettings) -> tuple[int, int]:
        """(warmup steps, decay steps) of Megatron's OptimizerParamScheduler, counted in trainer steps.

        `lr_decay_steps` defaults to the total training steps; a constant schedule
        without a known total only needs decay steps beyond the warmup.
        """
        o = trainer.optim
        total = self.lr_decay_steps or (o.total_training_steps if o.total_training_steps > 0 else None)
        if total is None:
            if self.lr_decay_style != "constant":
                raise ValueError(f"{_A}.optim.lr_decay_steps (or optim.total_training_steps / "
                                 f"trainer.total_training_steps) must be > 0 for lr_decay_style={self.lr_decay_style!r}")
            total = 0
        warmup = o.lr_warmup_steps if o.lr_warmup_steps > 0 else int(o.lr_warmup_steps_ratio * total)
        return warmup, max(total, warmup + 1)
