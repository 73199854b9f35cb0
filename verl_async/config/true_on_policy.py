"""Checks of `actor_rollout_ref.rollout.true_on_policy` (docs/true_on_policy.md): the engines,
trainers and settings it cannot serve are refused here, one line naming the key, before anything starts.

The mode makes the native engine and the FSDP2 trainer run the same batch-invariant kernels
(verl_async.invariant) in the same dtype; anything that would put other kernels on either side
(vLLM, Megatron, torch.compile, flash-attention, a second dtype) breaks the bitwise equality.
The model family is checked where the model is loaded (invariant.make_invariant).
"""

from __future__ import annotations

from omegaconf import DictConfig

from verl_async.config.errors import ConfigError

KEY = "actor_rollout_ref.rollout.true_on_policy"
_CANON = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


def mode_dtypes(cfg: DictConfig) -> tuple[str, str]:
    """(engine dtype, trainer compute dtype) as the run will use them: float32 on CPU for both, unless
    `engine_kwargs.native.dtype` asks the CPU engine for another; on accelerators rollout.dtype and
    actor.fsdp_config.mixed_precision.param_dtype."""
    r = cfg.actor_rollout_ref.rollout
    native = (r.engine_kwargs or {}).get("native") or {}
    if cfg.trainer.device == "cpu":
        return _CANON.get(str(native.get("dtype", "float32")), str(native.get("dtype"))), "float32"
    mp = cfg.actor_rollout_ref.actor.fsdp_config.get("mixed_precision") or {}
    engine = native.get("dtype", r.dtype)
    return _CANON.get(str(engine), str(engine)), _CANON.get(str(mp.get("param_dtype", "bf16")), "?")


def check_true_on_policy(cfg: DictConfig) -> None:
    a = cfg.actor_rollout_ref
    if not a.rollout.true_on_policy:
        return
    if a.rollout.name != "native":
        raise ConfigError(KEY, f"needs the native engine (actor_rollout_ref.rollout.name=native), got "
                               f"{a.rollout.name!r}: only the native engine runs the trainer's kernels")
    if a.actor.strategy == "megatron":
        raise ConfigError(KEY, "needs the FSDP2 trainer (actor_rollout_ref.actor.strategy=fsdp2): Megatron's "
                               "kernels are not the native engine's")
    if cfg.trainer.device not in ("cpu", "cuda"):
        raise ConfigError(KEY, f"runs on trainer.device=cpu or cuda, not {cfg.trainer.device!r} (untested there)")
    if a.rollout.tensor_model_parallel_size != 1:
        raise ConfigError(KEY, "needs actor_rollout_ref.rollout.tensor_model_parallel_size=1 (a sharded engine "
                               "reduces in another order)")
    engine_dtype, trainer_dtype = mode_dtypes(cfg)
    if engine_dtype != trainer_dtype:
        where = ("actor_rollout_ref.rollout.engine_kwargs.native.dtype (the CPU trainer runs float32)"
                 if cfg.trainer.device == "cpu" else
                 "actor_rollout_ref.rollout.dtype and actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype")
        raise ConfigError(KEY, f"the engine would compute in {engine_dtype} and the trainer in {trainer_dtype}; "
                               f"make them one dtype: {where}")
    if a.actor.use_torch_compile:
        raise ConfigError("actor_rollout_ref.actor.use_torch_compile",
                          f"true cannot run with {KEY}=true (compiled kernels change the arithmetic); set it to "
                          "false or null")
    native = (a.rollout.engine_kwargs or {}).get("native") or {}
    if native.get("compile_decode"):
        raise ConfigError("actor_rollout_ref.rollout.engine_kwargs.native.compile_decode",
                          f"true cannot run with {KEY}=true (compiled kernels change the arithmetic)")
    if a.model.attn_implementation not in (None, "auto"):
        raise ConfigError("actor_rollout_ref.model.attn_implementation",
                          f"{a.model.attn_implementation}: {KEY}=true brings its own attention (the engine's); "
                          "leave it auto")
