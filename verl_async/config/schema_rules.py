"""What the typed config schema is built from: the allowed values of choice keys, and `rule` / `schema`.

Shared by verl_async/config/schema.py (the root and the run-level sections) and
schema_actor_rollout_ref.py (verl's `actor_rollout_ref` group); docs in schema.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Allowed values. They mirror the registries of the modules that implement them
# (verl_async.algos, .data, .reward, .utils), which import torch/pyarrow; this module
# must not, so tests/test_config.py checks that the lists agree.
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# kl|k1, abs, mse|k2, low_var_kl|k3; a "+" suffix takes k2's gradient (straight-through), as in verl
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+")
KL_CTRL_TYPES = ("fixed", "adaptive")
# == verl_async.algos.policy_losses.POLICY_LOSSES (verl 0.9's registry)
POLICY_LOSS_MODES = ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo", "dppo_tv",
                     "dppo_kl", "bypass_mode")
ROLLOUT_NAMES = ("native", "vllm")
ROLLOUT_DTYPES = ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32")
TRUNCATIONS = ("error", "left", "right", "middle")
DEVICES = ("cuda", "npu", "cpu")  # == verl_async.utils.device.DEVICE_KINDS (not imported: it pulls in torch)
RESUME_MODES = ("auto", "disable", "resume_path")
STRATEGIES = ("fsdp", "fsdp2", "megatron")  # fsdp (verl's FSDP1) runs as fsdp2
SYNC_TRANSPORTS = ("auto", "object_store", "nccl", "hccl", "gloo", "cuda_ipc")
REWARD_MANAGERS = ("naive", "dapo")
LR_SCHEDULERS = ("constant", "cosine")
FSDP_ENGINE_STRATEGIES = ("fsdp", "fsdp2")  # verl 0.9's fsdp_config.strategy; both run as FSDP2
REWARD_MANAGER_SOURCES = ("register", "importlib")  # importlib (a custom class) is refused (config/verl09.py)
VERL_IS_LEVELS = ("token", "sequence")  # verl 0.9's algorithm.rollout_correction.rollout_is
VERL_CORRECTION_LOSSES = ("ppo_clip", "reinforce")  # bypass_mode's loss_type (algos/policy_losses.py)
SYNC_BACKENDS = ("nccl", "hccl")  # verl 0.9's rollout.checkpoint_engine.backend -> async_training.sync_transport
MEGATRON_DTYPES = ("bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
MCORE_LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
CORRECTION_MODES = ("truncate", "clip", "mask")
CORRECTION_VETO_RULES = ("old_prob", "ratio")  # == verl_async.algos.rollout_correction.VETO_RULES
PDSR_CAP_MODES = ("l_cut", "probe")  # == verl_async.rollout.pdsr_policy.CAP_MODES
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")  # verl's actor.checkpoint.save_contents
TOOL_CALL_FORMATS = ("hermes",)  # == verl_async.rollout.tool_parser.PARSERS
TRUNCATE_SIDES = ("left", "middle", "right")
SANITY_CHECK_MODES = ("disable", "strict", "ignore_strippable")


def rule(*, choices=None, ge=None, gt=None, le=None) -> Any:
    """A schema field with no default and simple value rules, checked by validate().

    A None value always passes (Optional fields); for list fields `choices` applies to
    each element.
    """
    meta = {k: v for k, v in dict(choices=choices, ge=ge, gt=gt, le=le).items() if v is not None}
    return field(metadata=meta)


schema = dataclass(kw_only=True)
