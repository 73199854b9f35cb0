"""verl 0.9's key layout beside the older one: what is not a plain copy (compat.ALIASES).

verl 0.9 chooses FSDP1/FSDP2 with `fsdp_config.strategy`, and spells rollout correction
as `algorithm.rollout_correction.{rollout_is, rollout_rs, ...}`; verl_async has FSDP2 only
and its own `actor_rollout_ref.actor.rollout_correction`. validate() calls `map_verl09`
after the schema merge (and after the aliases, which copy the `reward` group, bypass_mode
and the checkpoint_engine keys). Keys that exist in verl only for features verl_async
lacks (vision-language models, expert-parallel generation, LoRA adapters) are refused by
`refuse_unimplemented` before the merge, in one line saying so, not as "unknown key".
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from omegaconf import DictConfig

from verl_async.config.compat import warn_once
from verl_async.config.errors import ConfigError

_VLM = "vision-language (multi-modal) training is not implemented in verl_async; train a text-only model"
_LORA = "LoRA is not implemented in verl_async (full-parameter training only); remove it"
_EP = "expert-parallel MoE generation is not implemented in verl_async (dense models); leave it at 1"


class Unimplemented(NamedTuple):
    key: str
    why: str
    neutral: Tuple[Any, ...] = ()  # values that ask for nothing: the key is dropped silently


UNIMPLEMENTED: Tuple[Unimplemented, ...] = (
    Unimplemented("data.image_key", _VLM),
    Unimplemented("data.video_key", _VLM),
    Unimplemented("actor_rollout_ref.actor.freeze_vision_tower", _VLM, (False,)),
    Unimplemented("actor_rollout_ref.rollout.limit_images", _VLM, (None,)),
    Unimplemented("actor_rollout_ref.rollout.expert_parallel_size", _EP, (1,)),
    Unimplemented("actor_rollout_ref.model.lora.rank", _LORA, (0,)),
    Unimplemented("actor_rollout_ref.model.lora_adapter_path", _LORA, (None,)),
)


# verl values of verl_async keys that name a feature verl_async lacks: (key, value) -> why
UNIMPLEMENTED_VALUES: Dict[Tuple[str, str], str] = {
    ("actor_rollout_ref.rollout.name", "sglang"): "SGLang generation is not implemented; use one of: native, vllm",
    ("actor_rollout_ref.rollout.name", "trtllm"): "TensorRT-LLM generation is not implemented; use one of: native, vllm",
    ("actor_rollout_ref.rollout.name", "hf"): "HF generate() rollout is not implemented; use one of: native, vllm",
}


def _chain(raw: Dict[str, Any], key: str) -> Optional[List[dict]]:
    """The dicts from `raw` down to the one holding `key`; None when `key` is not set."""
    *parents, name = key.split(".")
    chain = [raw]
    for part in parents:
        child = chain[-1].get(part)
        if not isinstance(child, dict):
            return None
        chain.append(child)
    return chain if name in chain[-1] else None


def _drop(chain: List[dict], key: str) -> None:
    """Remove `key`, then every dict that leaves empty (an empty `lora: {}` would be an unknown key)."""
    parts = key.split(".")
    del chain[-1][parts[-1]]
    for depth in range(len(chain) - 1, 0, -1):
        if chain[depth]:
            break
        del chain[depth - 1][parts[depth - 1]]


def refuse_unimplemented(raw: Dict[str, Any]) -> None:
    """ConfigError for a verl key or value of a feature verl_async lacks; a neutral value is removed from `raw`."""
    for item in UNIMPLEMENTED:
        chain = _chain(raw, item.key)
        if chain is None:
            continue
        value = chain[-1][item.key.rsplit(".", 1)[-1]]
        if value not in item.neutral:
            raise ConfigError(item.key, f"{value!r}: {item.why}")
        _drop(chain, item.key)
    for (key, value), why in UNIMPLEMENTED_VALUES.items():
        chain = _chain(raw, key)
        if chain is not None and chain[-1][key.rsplit(".", 1)[-1]] == value:
            raise ConfigError(key, f"{value}: {why}")


def map_verl09(cfg: DictConfig) -> None:
    """Translate verl 0.9's FSDP strategy and rollout-correction keys in place (after the aliases)."""
    _fsdp_strategy(cfg)
    rc = cfg.algorithm.rollout_correction
    actor = cfg.actor_rollout_ref.actor
    ours = rollout_correction_from_verl(rc, bypass=bool(cfg.async_training.use_rollout_log_probs))
    if ours is None:
        return
    if actor.rollout_correction.enable:
        raise ConfigError("algorithm.rollout_correction.rollout_is",
                          "verl 0.9's algorithm.rollout_correction and actor_rollout_ref.actor.rollout_correction."
                          "enable=true are both set; set only one")
    for key, value in ours.items():
        actor.rollout_correction[key] = value


# --------------------------------------------------------------------------- FSDP strategy
def _fsdp_strategy(cfg: DictConfig) -> None:
    """verl: actor.strategy=fsdp names the FSDP family, fsdp_config.strategy picks FSDP1/FSDP2.

    verl_async has FSDP2 only: a run asks for FSDP1 when neither key says fsdp2 (or
    fsdp_config.strategy says fsdp), which is warned once and runs as FSDP2.
    """
    arr = cfg.actor_rollout_ref
    engine = {role: arr[role].fsdp_config.strategy for role in ("actor", "ref")}
    if arr.actor.strategy == "megatron":
        for role, value in engine.items():
            if value is not None:
                raise ConfigError(f"actor_rollout_ref.{role}.fsdp_config.strategy",
                                  f"{value}: an FSDP setting, but actor_rollout_ref.actor.strategy=megatron; remove it")
        return
    asks_fsdp1 = []
    if (engine["actor"] or arr.actor.strategy) == "fsdp":
        asks_fsdp1.append("actor_rollout_ref.actor." + ("fsdp_config.strategy" if engine["actor"] else "strategy"))
    if engine["ref"] == "fsdp" and engine["actor"] != "fsdp":  # set on its own (it follows the actor's by default)
        asks_fsdp1.append("actor_rollout_ref.ref.fsdp_config.strategy")
    for key in asks_fsdp1:
        warn_once(key, f"{key}=fsdp runs as fsdp2 (FSDP1 is not supported)")
    for role in ("actor", "ref"):
        arr[role].fsdp_config.strategy = "fsdp2"
        if arr[role].strategy == "fsdp":
            arr[role].strategy = "fsdp2"


# --------------------------------------------------------------------------- rollout correction
_RC = "algorithm.rollout_correction"
# verl's k1 rejection options -> the level of verl_async's rs weight
RS_LEVELS = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}


def _number(key: str, spec: Any) -> float:
    try:
        value = float(spec)
    except (TypeError, ValueError):
        raise ConfigError(key, f"expected a number or 'lower_upper', got {spec!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(key, f"bounds must be positive numbers, got {spec!r}")
    return value


def parse_bounds(key: str, spec: Any) -> Tuple[Optional[float], float]:
    """verl's threshold spelling: a number u -> (None, u); "lower_upper" -> (lower, upper)."""
    if isinstance(spec, str) and "_" in spec:
        low, _, high = spec.partition("_")
        lower, upper = _number(key, low), _number(key, high)
        if lower > upper:
            raise ConfigError(key, f"lower bound {lower:g} > upper bound {upper:g} in {spec!r}")
        return lower, upper
    return None, _number(key, spec)


def rollout_correction_from_verl(rc: Any, *, bypass: bool) -> Optional[Dict[str, Any]]:
    """verl 0.9's algorithm.rollout_correction as actor.rollout_correction values; None when it asks for none.

    Both compare the recomputed old policy with the rollout's: r = pi_old / pi_rollout.
    IS (`rollout_is` token|sequence): a number is verl's TIS, w = min(r, u) (mode truncate);
    "lower_upper" is IcePop, verl zeroes the weight of tokens outside and verl_async drops
    them from the loss mask (mode mask: they also leave the token-mean denominator).
    Rejection (`rollout_rs`): verl's k1 statistic is -log r, kept within [log lower, log
    upper], i.e. 1/upper <= r <= 1/lower at the token, sequence-sum (product) or
    sequence-mean (geometric) level: verl_async's rs bounds on r. k2/k3 statistics, several
    options, rejection without IS weights, corrections in bypass mode and the reinforce loss
    are not implemented: each is refused naming its key.
    """
    if rc.loss_type != "ppo_clip":
        raise ConfigError(f"{_RC}.loss_type", f"{rc.loss_type} is not implemented; verl_async trains with the PPO "
                                               "clipped objective: use ppo_clip")
    if rc.rollout_is is None and rc.rollout_rs is None:
        if rc.rollout_is_batch_normalize:
            warn_once(f"{_RC}.rollout_is_batch_normalize",
                      f"{_RC}.rollout_is_batch_normalize=true has no effect with rollout_is=null (as in verl)")
        return None
    which = f"{_RC}.rollout_is" if rc.rollout_is is not None else f"{_RC}.rollout_rs"
    if bypass:
        raise ConfigError(which, "is not implemented with bypass_mode=true (the rollout's log-probs as the old "
                                 f"policy: every weight would be 1); set {_RC}.bypass_mode=false to correct against "
                                 "recomputed old log-probs")
    if rc.rollout_is is None:
        raise ConfigError(f"{_RC}.rollout_rs", "rejection without importance weights (rollout_is=null) is not "
                                               f"implemented; set {_RC}.rollout_is=token or sequence")
    lower, upper = parse_bounds(f"{_RC}.rollout_is_threshold", rc.rollout_is_threshold)
    out: Dict[str, Any] = {"enable": True, "level": rc.rollout_is, "mode": "truncate" if lower is None else "mask",
                           "lower": lower, "upper": upper, "batch_normalize": bool(rc.rollout_is_batch_normalize)}
    if rc.rollout_rs is not None:
        out.update(_rejection(rc.rollout_rs, rc.rollout_rs_threshold))
    return out


def _rejection(option: str, threshold: Any) -> Dict[str, Any]:
    key = f"{_RC}.rollout_rs"
    if option not in RS_LEVELS:
        what = "several options" if "," in option else repr(option)
        raise ConfigError(key, f"{what} not implemented; verl_async rejects on one ratio bound: "
                               f"{', '.join(RS_LEVELS)}")
    if threshold is None:
        raise ConfigError(f"{_RC}.rollout_rs_threshold", f"must be set when rollout_rs={option} (as in verl)")
    lower, upper = parse_bounds(f"{_RC}.rollout_rs_threshold", threshold)
    lower = 1.0 / upper if lower is None else lower
    # -log r within [log lower, log upper]  <=>  r within [1/upper, 1/lower]
    return {"rs": True, "rs_level": RS_LEVELS[option], "rs_lower": 1.0 / upper, "rs_upper": 1.0 / lower}
