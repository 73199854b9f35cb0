"""verl keys that verl_async accepts but does not use, and verl spellings it maps.

COMPAT_KEYS lists every key that is accepted only so that verl launch scripts run
unchanged. When a run sets one to a value other than its default, a warning names
the key once per process. A module that starts to use one of these keys removes it
from the list. A dict default covers a free-form node: each entry set under it is
named by its full key.
"""

from __future__ import annotations

import logging
from typing import Any, Collection, Dict, List, NamedTuple, Tuple

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("verl_async.config")


class Compat(NamedTuple):
    default: Any
    why: str = ""
    used_by: str = ""  # a trainer strategy that does use the key (no warning under it)


_UNUSED_FSDP = "verl_async's FSDP2/Megatron workers do not use it"

COMPAT_KEYS: Dict[str, Compat] = {
    "data.train_batch_size": Compat(0, "each trainer step takes ppo_mini_batch_size * async_training.require_batches prompts"),
    "data.val_batch_size": Compat(None),
    "data.return_raw_input_ids": Compat(False),
    "data.return_raw_chat": Compat(False, "prompts are always kept as chat messages"),
    "data.return_full_prompt": Compat(False),
    "data.use_shm": Compat(False),
    "data.dataloader_num_workers": Compat(0),
    "data.filter_overlong_prompts_workers": Compat(1),
    "data.gen_batch_size": Compat(1, "the Rollouter hands a prompt to the engines as soon as one has room"),
    "data.apply_chat_template_kwargs": Compat({}),
    "actor_rollout_ref.hybrid_engine": Compat(False, "rollout and training never share devices in fully async mode"),
    "actor_rollout_ref.nccl_timeout": Compat(600),
    "actor_rollout_ref.model.use_fused_kernels": Compat(False, _UNUSED_FSDP),
    "actor_rollout_ref.model.fused_kernel_options": Compat({"impl_backend": "torch"}, _UNUSED_FSDP),
    "actor_rollout_ref.model.use_liger": Compat(False, _UNUSED_FSDP),
    "actor_rollout_ref.model.use_shm": Compat(False),
    "actor_rollout_ref.model.external_lib": Compat(None),
    "actor_rollout_ref.model.enable_activation_offload": Compat(False, _UNUSED_FSDP),
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": Compat(
        -1, "the FSDP2 trainer shards parameters over all its ranks, without hybrid sharding; the numbers are the same"),
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch": Compat(False, _UNUSED_FSDP),
    "actor_rollout_ref.actor.optim.override_optimizer_config": Compat({}, "only the Megatron trainer uses it", "megatron"),
    "actor_rollout_ref.actor.megatron.use_mbridge": Compat(False, "weights are converted by verl_async itself"),
    "actor_rollout_ref.actor.megatron.vanilla_mbridge": Compat(False, "weights are converted by verl_async itself"),
    "actor_rollout_ref.actor.megatron.use_remove_padding": Compat(
        True, "the Megatron trainer runs right-padded rows (the loss and gradients are the same)"),
    "actor_rollout_ref.actor.megatron.use_dist_checkpointing": Compat(False, "the model loads from actor_rollout_ref.model.path"),
    "actor_rollout_ref.actor.megatron.dist_checkpointing_path": Compat(None),
    "actor_rollout_ref.ref.megatron.use_dist_checkpointing": Compat(False, "the model loads from actor_rollout_ref.model.path"),
    "actor_rollout_ref.ref.megatron.dist_checkpointing_path": Compat(None),
    "actor_rollout_ref.rollout.mode": Compat("async", "generation is always asynchronous"),
    "actor_rollout_ref.rollout.layered_summon": Compat(
        False, "the trainer's weights always leave one parameter at a time (LoRA layers merged as they come)"),
    "actor_rollout_ref.rollout.enable_sleep_mode": Compat(
        False, "fully async engines keep their devices: there is no training phase to free them for"),
    "actor_rollout_ref.rollout.calculate_log_probs": Compat(True, "rollout log-probs are always recorded"),
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template": Compat(
        False, "the trained tokens are always the ones the model generated"),
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": Compat(
        "strict", "turns are tokenised once, as appended; nothing is re-tokenised to compare"),
    "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts": Compat(None, "use actor_rollout_ref.rollout.n"),
    "reward.reward_manager.module": Compat({"path": None, "name": "custom_reward_manager"},
                                           "custom reward manager classes are not supported"),
    "trainer.critic_warmup": Compat(0, "there is no critic"),
    "trainer.default_hdfs_dir": Compat(None),
    "trainer.del_local_ckpt_after_load": Compat(False),
    "trainer.max_critic_ckpt_to_keep": Compat(None, "there is no critic"),
    "trainer.ray_wait_register_center_timeout": Compat(300),
    "trainer.esi_redundant_time": Compat(0),
    "trainer.use_legacy_worker_impl": Compat("auto"),
    "async_training.checkpoint_engine.bypass_cpu": Compat(False),
    "critic": Compat({}, "there is no critic"),
    "global_profiler": Compat({}),
}

class Alias(NamedTuple):
    """A verl spelling whose value, when set (not null, not {}: see `unset`), is copied onto the key verl_async reads.

    `dst_default` is dst's YAML default: a dst holding anything else was set by the run too,
    and a different value there is a conflict (validate() names src).
    """

    src: str
    dst: str
    dst_default: Any = None


_BYPASS = "algorithm.rollout_correction.bypass_mode"
_BUCKET = "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"

ALIASES: Tuple[Alias, ...] = (
    Alias("ray_kwargs.ray_init.num_cpus", "ray_init.num_cpus"),
    Alias("ray_kwargs.ray_init.runtime_env", "ray_init.runtime_env", {"py_executable": None}),
    Alias("ray_kwargs.timeline_json_file", "ray_init.timeline_json_file"),
    # verl 0.9's `reward` group onto the older layout that verl_async.reward reads
    Alias("reward.num_workers", "reward_model.num_workers", 1),
    Alias("reward.reward_manager.name", "reward_model.reward_manager", "naive"),
    Alias("reward.reward_kwargs", "reward_model.reward_kwargs", {}),
    Alias("reward.custom_reward_function.path", "custom_reward_function.path"),
    Alias("reward.custom_reward_function.name", "custom_reward_function.name", "compute_score"),
    # verl 0.9: bypass_mode=true trains with the rollout's log-probs as the old policy
    Alias(_BYPASS, "async_training.use_rollout_log_probs", True),
    Alias(_BYPASS, "actor_rollout_ref.actor.use_rollout_log_probs", True),
    # verl 0.9's weight-sync settings (one bucket size for every transport, as sync_bucket_size_mb)
    Alias("actor_rollout_ref.rollout.checkpoint_engine.backend", "async_training.sync_transport", "auto"),
    Alias(_BUCKET, "async_training.sync_bucket_size_mb", 256),
    Alias(_BUCKET, "async_training.checkpoint_engine.device_buffer_size_M", 256),
)

_ABSENT = object()
_warned: set = set()


def unset(value: Any) -> bool:
    """An alias source nobody set: null, {}, or a mapping of such (verl's `runtime_env: {py_executable: null}`)."""
    if isinstance(value, dict):
        return all(unset(v) for v in value.values())
    return value is None


def _changed(key: str, value: Any, default: Any) -> List[Tuple[str, Any]]:
    if isinstance(value, dict) and isinstance(default, dict):
        out: List[Tuple[str, Any]] = []
        for k, v in value.items():
            out += _changed(f"{key}.{k}", v, default.get(k, _ABSENT))
        return out
    return [] if value == default else [(key, value)]


def compat_keys_set(cfg: DictConfig, skip: Collection[str] = ()) -> List[Tuple[str, Any]]:
    """(full key, value) of every compatibility-only key set to a non-default value (`skip`: used by this run)."""
    out: List[Tuple[str, Any]] = []
    strategy = OmegaConf.select(cfg, "actor_rollout_ref.actor.strategy", default=None)
    for key, compat in COMPAT_KEYS.items():
        if (compat.used_by and compat.used_by == strategy) or key in skip:
            continue
        node = OmegaConf.select(cfg, key, default=_ABSENT)
        if node is _ABSENT:
            continue
        value = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        out += _changed(key, value, compat.default)
    return out


def _why(key: str) -> str:
    for prefix, compat in COMPAT_KEYS.items():
        if key == prefix or key.startswith(prefix + "."):
            return compat.why
    return ""


def warn_once(key: str, message: str) -> bool:
    """Log `message` unless a warning about `key` was logged before in this process."""
    if key in _warned:
        return False
    _warned.add(key)
    log.warning(message)
    return True


def warn_compat_keys(cfg: DictConfig, skip: Collection[str] = ()) -> List[str]:
    """Log one warning per compatibility-only key set in `cfg` (once per process); return them."""
    fresh = []
    for key, value in compat_keys_set(cfg, skip):
        why = _why(key)
        message = f"{key}={value!r} is accepted for verl compatibility but not used by verl_async"
        if warn_once(key, message + (f" ({why})" if why else "")):
            fresh.append(key)
    return fresh


def reset_compat_warnings() -> None:
    """Forget which keys were warned about (tests)."""
    _warned.clear()
