"""verl's V1 trainer keys (`trainer.use_v1=True trainer.v1.*`) onto verl_async's own keys.

verl 0.9 made its V1 trainer the default and retires the fully-async recipe for it
(`trainer.v1.trainer_mode=separate_async`). A V1 global step is one weight version: it
samples `data.train_batch_size` prompts as `parameter_sync_step` mini-batches, one PPO update
each, then syncs; `num_warmup_batches` train batches are generated ahead. Here a trainer step
takes `ppo_mini_batch_size x require_batches` groups and the weights move every
`trigger_parameter_sync_step` steps, with the Rollouter at most `staleness_threshold` such
batches ahead (docs/architecture.md "Staleness"). So, with P = parameter_sync_step
(1 unless separate_async), B = data.train_batch_size, m = ppo_mini_batch_size:

    trigger_parameter_sync_step = P            require_batches = B / (P x m)
    staleness_threshold         = num_warmup_batches (0 in sync)
    partial_rollout             = mode != sync rollout.colocate = mode != separate_async
    trainer.total_training_steps x P           (V1 counts weight versions, verl_async trainer steps)
    max_off_policy_strategy=drop, threshold T  -> algorithm.max_staleness = T - 1 (off_policy.py)

`wait` and the oldest-first order of V1's sampler are read at run time (`off_policy_wait`,
`oldest_first`). verl's rule for separate_async, B = P x m, is checked with verl's message.
A V1 key and the fully-async key it sets, both set and different: one line naming both.
Keys the schema does not hold (V1 scripts set them on `actor_rollout_ref.rollout`, `skip`)
are translated or refused on the raw config by `pre_merge`, before the schema merge.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from verl_async.config.compat import warn_once
from verl_async.config.errors import ConfigError

_V1 = "trainer.v1"
_ROLLOUT = "actor_rollout_ref.rollout"

# verl_async's YAML defaults of the keys the mapping sets: a value other than these was set by the run
# (tests/test_config_verl_v1.py checks them against config/*.yaml)
OURS_DEFAULTS: Dict[str, Any] = {
    "async_training.staleness_threshold": 0.5,
    "async_training.trigger_parameter_sync_step": None,  # null: derived.auto_trigger_parameter_sync_step
    "async_training.require_batches": 1,
    "async_training.partial_rollout": True,
    "rollout.colocate": False,
    "rollout.nnodes": 1,
    "rollout.n_gpus_per_node": 1,
    "algorithm.max_staleness": None,
}
# the V1 keys' defaults (config/trainer_v1/default.yaml): with use_v1=false a changed one is warned about
V1_DEFAULTS: Dict[str, Any] = {
    "trainer_mode": "sync",
    "sync": {},
    "colocate_async": {"num_warmup_batches": 1.0},
    "separate_async": {"num_warmup_batches": 1.0, "parameter_sync_step": 4, "hybrid_rollout": {
        "enable_switch": False, "switch_threshold_ratio": 0.4, "adaptive_switch_threshold": True,
        "switch_threshold_step_up": 0.05, "switch_threshold_step_down": 0.03, "switch_threshold_release_steps": 2,
        "switch_cost_window_size": 3}},
    "sampler": {"max_off_policy_threshold": 8, "max_off_policy_strategy": "drop", "sync_refill_failed_groups": False,
                "custom_sampler": {"path": None, "name": None}, "sampler_kwargs": {}},
}


# --------------------------------------------------------------------------- before the schema merge
def _pop(raw: Dict[str, Any], key: str) -> Tuple[bool, Any]:
    """(found, value) of `key` in `raw`, removed (and its parents when left empty)."""
    *parents, name = key.split(".")
    chain = [raw]
    for part in parents:
        child = chain[-1].get(part)
        if not isinstance(child, dict):
            return False, None
        chain.append(child)
    if name not in chain[-1]:
        return False, None
    value = chain[-1].pop(name)
    for depth in range(len(chain) - 1, 0, -1):
        if chain[depth]:
            break
        del chain[depth - 1][parents[depth - 1]]
    return True, value


def _get(raw: Dict[str, Any], key: str, default: Any = None) -> Any:
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _put(raw: Dict[str, Any], key: str, value: Any) -> None:
    *parents, name = key.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[name] = value


def _enabled_paths(node: Any, prefix: str) -> List[Tuple[str, Any]]:
    """Every `enable`-like switch under `node` that is on (verl's skip.* sections)."""
    if not isinstance(node, dict):
        return []
    out: List[Tuple[str, Any]] = []
    for name, value in node.items():
        key = f"{prefix}.{name}"
        if isinstance(value, dict):
            out += _enabled_paths(value, key)
        elif name == "enable" and value:
            out.append((key, value))
    return out


def pre_merge(raw: Dict[str, Any]) -> None:
    """V1-script keys the schema does not hold: translated onto ours in `raw`, or refused in one line."""
    # V1 separate_async sizes its standalone rollout with actor_rollout_ref.rollout.{nnodes,n_gpus_per_node}
    for name in ("nnodes", "n_gpus_per_node"):
        found, value = _pop(raw, f"{_ROLLOUT}.{name}")
        if not found:
            continue
        current = _get(raw, f"rollout.{name}", OURS_DEFAULTS[f"rollout.{name}"])
        if current not in (OURS_DEFAULTS[f"rollout.{name}"], value):
            raise ConfigError(f"{_ROLLOUT}.{name}", f"{value!r} conflicts with rollout.{name}={current!r}; set only one")
        _put(raw, f"rollout.{name}", value)
    found, workers = _pop(raw, f"{_ROLLOUT}.agent.num_workers")
    if found:
        warn_once(f"{_ROLLOUT}.agent.num_workers", f"{_ROLLOUT}.agent.num_workers={workers!r} is accepted for verl "
                  "compatibility but not used by verl_async (the Rollouter runs every trajectory as a task of its own)")
    if _get(raw, f"{_ROLLOUT}.checkpoint_engine.backend") == "naive":
        # verl's default: an in-process handoff between colocated workers; here `auto` picks the transport
        _put(raw, f"{_ROLLOUT}.checkpoint_engine.backend", None)
    found, skip = _pop(raw, "skip")
    for key, value in _enabled_paths(skip if found else {}, "skip"):
        raise ConfigError(key, f"{value!r}: verl's rollout skip (dump rollouts to dump_dir and replay them) is not "
                               "implemented; use debug.save_rollout_data / debug.load_rollout_data")


# --------------------------------------------------------------------------- after the merge
def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _set(cfg: DictConfig, key: str, value: Any, source: str, source_value: Any) -> None:
    """Set our `key` from a V1 key; both set by the run to different values is a conflict."""
    current = _plain(OmegaConf.select(cfg, key))
    if current != OURS_DEFAULTS[key] and current != value:
        shown = f"{source_value!r}" + ("" if source_value == value else f" (-> {key}={value!r})")
        raise ConfigError(source, f"{shown} conflicts with {key}={current!r}; set only one")
    OmegaConf.update(cfg, key, value, merge=False)


def _changed(value: Any, default: Any, prefix: str) -> List[str]:
    if isinstance(value, dict) and isinstance(default, dict):
        return [k for name, v in value.items() for k in _changed(v, default.get(name), f"{prefix}.{name}")]
    return [] if value == default else [prefix]


def _inert(cfg: DictConfig, section: str, switch: str, defaults: Dict[str, Any]) -> None:
    """Keys of a feature that is off, set anyway: named once (they do nothing, as in verl)."""
    node = OmegaConf.select(cfg, section)
    if node is None or node[switch]:
        return
    for key in _changed({k: v for k, v in _plain(node).items() if k in defaults}, defaults, section):
        warn_once(key, f"{key}={_plain(OmegaConf.select(cfg, key))!r} has no effect with {section}.{switch}=false "
                       f"(as in verl)")


def map_verl_v1(cfg: DictConfig) -> None:
    """With `trainer.use_v1=true`, the V1 keys decide the run's mode and batch (module docstring); in place."""
    _inert(cfg, "reward.reward_model", "enable", {"model_path": None})
    _inert(cfg, "distillation", "enabled", {"teacher_key": "data_source"})
    v1 = cfg.trainer.v1
    if not cfg.trainer.use_v1:
        for key in _changed(_plain(v1), V1_DEFAULTS, _V1):
            warn_once(key, f"{key} has no effect with trainer.use_v1=false (as in verl); set trainer.use_v1=true")
        return
    mode = str(v1.trainer_mode)
    separate = mode == "separate_async"
    if separate and v1.separate_async.hybrid_rollout.enable_switch:
        raise ConfigError(f"{_V1}.separate_async.hybrid_rollout.enable_switch",
                          "true: lending idle trainer GPUs to generation is not implemented; the trainer's idle time "
                          "shows in fully_async/trainer_idle_ratio: give the rollout more devices (rollout.n_gpus_per_"
                          "node) or raise num_warmup_batches instead")
    if v1.sampler.custom_sampler.path:
        raise ConfigError(f"{_V1}.sampler.custom_sampler.path",
                          f"{v1.sampler.custom_sampler.path}: a custom ReplayBuffer class (verl's TransferQueue "
                          "sampler interface) is not supported; groups are taken from the MessageQueue")
    if _plain(v1.sampler.sampler_kwargs):
        warn_once(f"{_V1}.sampler.sampler_kwargs", f"{_V1}.sampler.sampler_kwargs is only read by a custom sampler; "
                                                   "ignored (as in verl without one)")
    sync_step = int(v1.separate_async.parameter_sync_step) if separate else 1
    sync_key = f"{_V1}.separate_async.parameter_sync_step"
    mini = int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    batch = _train_batch_size(cfg, sync_step, mini, mode, sync_key)
    _set(cfg, "async_training.trigger_parameter_sync_step", sync_step, sync_key if separate else f"{_V1}.trainer_mode",
         sync_step if separate else mode)
    _set(cfg, "async_training.require_batches", batch // (sync_step * mini), "data.train_batch_size", batch)
    warmup_key = f"{_V1}.{mode}.num_warmup_batches"
    warmup = 0.0 if mode == "sync" else float(v1[mode].num_warmup_batches)
    _set(cfg, "async_training.staleness_threshold", warmup, warmup_key if mode != "sync" else f"{_V1}.trainer_mode",
         warmup if mode != "sync" else mode)
    _set(cfg, "async_training.partial_rollout", mode != "sync", f"{_V1}.trainer_mode", mode)
    _set(cfg, "rollout.colocate", not separate, f"{_V1}.trainer_mode", mode)
    if not separate:  # V1 sync / colocate_async: the engines run on the trainer's devices
        for name in ("nnodes", "n_gpus_per_node"):
            _set(cfg, f"rollout.{name}", int(cfg.trainer[name]), f"{_V1}.trainer_mode", mode)
    if cfg.trainer.total_training_steps is not None:  # V1 counts weight versions; a trainer step is a mini-batch
        cfg.trainer.total_training_steps = int(cfg.trainer.total_training_steps) * sync_step
    sampler = v1.sampler
    if mode != "sync" and sampler.max_off_policy_threshold is not None and sampler.max_off_policy_strategy == "drop":
        threshold = int(sampler.max_off_policy_threshold)
        _set(cfg, "algorithm.max_staleness", threshold - 1, f"{_V1}.sampler.max_off_policy_threshold", threshold)


def _train_batch_size(cfg: DictConfig, sync_step: int, mini: int, mode: str, sync_key: str) -> int:
    """data.train_batch_size under V1, checked with verl's messages (0, verl_async's default: P x m)."""
    batch = int(cfg.data.train_batch_size)
    if batch <= 0:
        cfg.data.train_batch_size = sync_step * mini
        return sync_step * mini
    if batch % sync_step:  # verl/trainer/ppo/v1/trainer_base.py
        raise ConfigError("data.train_batch_size", f"train_batch_size ({batch}) must be divisible by "
                                                   f"parameter_sync_step ({sync_step})")
    if mode == "separate_async" and batch != sync_step * mini:  # verl/trainer/ppo/v1/trainer_separate_async.py
        raise ConfigError("data.train_batch_size",
                          "train_batch_size must equal parameter_sync_step * ppo_mini_batch_size in separate async "
                          f"training, but got train_batch_size={batch}, parameter_sync_step={sync_step}, "
                          f"ppo_mini_batch_size={mini}")
    if batch % mini:
        raise ConfigError("data.train_batch_size",
                          f"train_batch_size ({batch}) must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size "
                          f"({mini}): a V1 {mode} step updates on train_batch_size / ppo_mini_batch_size mini-batches")
    return batch


# --------------------------------------------------------------------------- read at run time
def used_keys(cfg: Any) -> frozenset:
    """Keys compat.py lists as unused that a V1 run does use (no 'not used' warning for them)."""
    return frozenset({"data.train_batch_size"}) if OmegaConf.select(cfg, "trainer.use_v1", default=False) else frozenset()


def off_policy_wait(cfg: Any) -> Optional[int]:
    """The span the trainer waits at (`max_off_policy_strategy=wait` in an async V1 mode), else None."""
    if not OmegaConf.select(cfg, "trainer.use_v1", default=False):
        return None
    sampler = cfg.trainer.v1.sampler
    if cfg.trainer.v1.trainer_mode == "sync" or sampler.max_off_policy_strategy != "wait":
        return None
    return None if sampler.max_off_policy_threshold is None else int(sampler.max_off_policy_threshold)


def oldest_first(cfg: Any) -> bool:
    """V1's sampler trains the groups admitted earliest first (verl_async's queue is FIFO by completion)."""
    return bool(OmegaConf.select(cfg, "trainer.use_v1", default=False))
