"""verl 0.9's key layout beside the older one: what is not a plain copy (compat.ALIASES).

verl 0.9 chooses FSDP1/FSDP2 with `fsdp_config.strategy`, and spells rollout correction
as `algorithm.rollout_correction.{rollout_is, rollout_rs, ...}`; verl_async has FSDP2 only
and its own `actor_rollout_ref.actor.rollout_correction`. validate() calls `map_verl09`
after the schema merge (and after the aliases, which copy the `reward` group, bypass_mode
and the checkpoint_engine keys). Keys that exist in verl only for features verl_async
lacks (vision-language models, expert-parallel generation, Megatron LoRA, MTP) are refused by
`refuse_unimplemented` before the merge, in one line saying so, not as "unknown key".
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from verl_async.config.compat import warn_once
from verl_async.config.errors import ConfigError

_VLM = "vision-language (multi-modal) training is not implemented in verl_async; train a text-only model"
_LORA = ("verl's Megatron LoRA (model.lora.*) is not implemented in verl_async; LoRA trains with the FSDP2 "
         "trainer: set actor_rollout_ref.model.lora_rank (and lora_alpha, target_modules) instead")
_EP = "expert-parallel MoE generation is not implemented in verl_async (dense models); leave it at 1"
# also checks.no_expert_parallelism's words (the ref's and expert-tensor sizes, after the merge)
EP_TRAIN = "MoE expert parallelism is not implemented (the Megatron trainer converts dense models); set it to 1"
_MFSDP = ("Megatron-FSDP is not implemented in verl_async (the Megatron trainer shards its optimizer with "
          "use_distributed_optimizer); leave it false")
_MTP = ("multi-token prediction (MTP: an extra head trained and used for speculative decoding) is not implemented "
        "in verl_async; set mtp.enable, enable_train and enable_rollout to false")


class Unimplemented(NamedTuple):
    key: str
    why: str
    neutral: Tuple[Any, ...] = ()  # values that ask for nothing: the key is dropped silently
    ours: bool = False  # a key of verl_async's schema too (checked early, kept)


UNIMPLEMENTED: Tuple[Unimplemented, ...] = (
    Unimplemented("data.image_key", _VLM),
    Unimplemented("data.video_key", _VLM),
    Unimplemented("actor_rollout_ref.actor.freeze_vision_tower", _VLM, (False,)),
    Unimplemented("actor_rollout_ref.rollout.limit_images", _VLM, (None,)),
    Unimplemented("actor_rollout_ref.rollout.expert_parallel_size", _EP, (1,)),
    # before the merge: a MoE script is told so before any other key of it
    Unimplemented("actor_rollout_ref.actor.megatron.expert_model_parallel_size", EP_TRAIN, (1,), ours=True),
    Unimplemented("actor_rollout_ref.actor.megatron.use_megatron_fsdp", _MFSDP, (False,)),
    Unimplemented("actor_rollout_ref.ref.megatron.use_megatron_fsdp", _MFSDP, (False,)),
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


# verl nodes of a feature verl_async lacks: node -> (the switches that ask for it, why); switched off, the node goes
UNIMPLEMENTED_NODES: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "actor_rollout_ref.model.mtp": (("enable", "enable_train", "enable_rollout"), _MTP),
    "actor_rollout_ref.model.lora": (("rank",), _LORA),
}


def refuse_unimplemented(raw: Dict[str, Any]) -> None:
    """ConfigError for a verl key or value of a feature verl_async lacks; a neutral value is removed from `raw`."""
    for item in UNIMPLEMENTED:
        chain = _chain(raw, item.key)
        if chain is None:
            continue
        value = chain[-1][item.key.rsplit(".", 1)[-1]]
        if value not in item.neutral:
            raise ConfigError(item.key, f"{value!r}: {item.why}")
        if not item.ours:
            _drop(chain, item.key)
    for (key, value), why in UNIMPLEMENTED_VALUES.items():
        chain = _chain(raw, key)
        if chain is not None and chain[-1][key.rsplit(".", 1)[-1]] == value:
            raise ConfigError(key, f"{value}: {why}")
    for node, (switches, why) in UNIMPLEMENTED_NODES.items():
        chain = _chain(raw, node)
        if chain is None:
            continue
        value = chain[-1][node.rsplit(".", 1)[-1]]
        on = [k for k in switches if isinstance(value, dict) and value.get(k) not in (None, False)]
        if on:
            raise ConfigError(f"{node}.{on[0]}", f"{value[on[0]]!r}: {why}")
        _drop(chain, node)


def map_verl09(cfg: DictConfig) -> None:
    """Translate verl 0.9's FSDP strategy and rollout-correction keys in place (after the aliases)."""
    _fsdp_strategy(cfg)
    rc = cfg.algorithm.rollout_correction
    actor = cfg.actor_rollout_ref.actor
    bypass = bool(cfg.async_training.use_rollout_log_probs)
    if bypass:
        bypass_loss(cfg)
        return
    ours = rollout_correction_from_verl(rc)
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


def rollout_correction_from_verl(rc: Any) -> Optional[Dict[str, Any]]:
    """verl 0.9's algorithm.rollout_correction as actor.rollout_correction values; None when it asks for none.

    Decoupled mode (bypass=false; bypass mode is `bypass_loss`). Both compare the recomputed old
    policy with the rollout's: r = pi_old / pi_rollout.
    IS (`rollout_is` token|sequence): a number is verl's TIS, w = min(r, u) (mode truncate);
    "lower_upper" is IcePop, verl zeroes the weight of tokens outside and verl_async drops
    them from the loss mask (mode mask: they also leave the token-mean denominator).
    Rejection (`rollout_rs`): verl's k1 statistic is -log r, kept within [log lower, log
    upper], i.e. 1/upper <= r <= 1/lower at the token, sequence-sum (product) or
    sequence-mean (geometric) level: verl_async's rs bounds on r. Here k2/k3 statistics, several
    options and rejection without IS weights are not implemented: each is refused naming its key
    (bypass mode takes all of verl's options).
    """
    if rc.loss_type != "ppo_clip":
        warn_once(f"{_RC}.loss_type", f"{_RC}.loss_type={rc.loss_type} has no effect with bypass_mode=false (as in "
                                      "verl: it picks bypass mode's loss)")
    if rc.rollout_is is None and rc.rollout_rs is None:
        if rc.rollout_is_batch_normalize:
            warn_once(f"{_RC}.rollout_is_batch_normalize",
                      f"{_RC}.rollout_is_batch_normalize=true has no effect with rollout_is=null (as in verl)")
        return None
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


# --------------------------------------------------------------------------- bypass mode
_PL = "actor_rollout_ref.actor.policy_loss"
_BYPASS_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                "rollout_rs_threshold", "loss_type")


def bypass_loss(cfg: DictConfig) -> None:
    """verl's bypass mode (the rollout's log-probs are the old policy) with a correction: the bypass_mode loss.

    verl's `apply_bypass_mode` copies algorithm.rollout_correction into actor.policy_loss.rollout_correction
    and sets policy_loss.loss_mode=bypass_mode: per micro-batch, log r = log pi - log pi_rollout of the
    policy being trained gives the `rollout_rs` rejection and the `rollout_is` weights (which reinforce
    uses and ppo_clip only logs). verl 0.9.1 makes that switch on the driver after its workers were built,
    so there it has no effect (verl-project/verl#4912, fix in #4930); verl_async does what verl documents.
    Without rollout_is, rollout_rs and reinforce the loss is the plain one against the rollout's log-probs
    (bypass_mode's ppo_clip is vanilla then), so any policy_loss.loss_mode runs unchanged.
    """
    rc = cfg.algorithm.rollout_correction
    pl = cfg.actor_rollout_ref.actor.policy_loss
    if rc.rollout_is is None and rc.rollout_rs is None and rc.loss_type == "ppo_clip":
        if rc.rollout_is_batch_normalize:
            warn_once(f"{_RC}.rollout_is_batch_normalize",
                      f"{_RC}.rollout_is_batch_normalize=true has no effect with rollout_is=null (as in verl)")
        _check_bypass_spec(pl)
        return
    which = next(k for k in ("rollout_is", "rollout_rs", "loss_type")
                 if rc[k] is not None and (k != "loss_type" or rc[k] != "ppo_clip"))
    if pl.loss_mode not in ("vanilla", "bypass_mode"):
        raise ConfigError(f"{_PL}.loss_mode", f"{pl.loss_mode}: {_RC}.{which} with bypass_mode=true trains with "
                                              "verl's bypass_mode loss (PPO clip or REINFORCE against the rollout "
                                              "policy); use loss_mode=vanilla, or bypass_mode=false to keep "
                                              f"{pl.loss_mode}")
    default = OmegaConf.create({"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
                                "rollout_rs": None, "rollout_rs_threshold": None, "loss_type": "ppo_clip"})
    for key in _BYPASS_KEYS:
        ours = pl.rollout_correction[key]
        if ours != default[key] and ours != rc[key]:
            raise ConfigError(f"{_RC}.{key}", f"{rc[key]!r} conflicts with {_PL}.rollout_correction.{key}={ours!r}; "
                                              "set only one")
        pl.rollout_correction[key] = rc[key]
    pl.loss_mode = "bypass_mode"
    _check_bypass_spec(pl)


def _check_bypass_spec(pl: DictConfig) -> None:
    """The bypass_mode loss's correction, checked here so a bad spec fails before anything starts."""
    if pl.loss_mode != "bypass_mode":
        return
    bc = pl.rollout_correction
    key = f"{_PL}.rollout_correction"
    if bc.rollout_is_batch_normalize and bc.rollout_is is not None and bc.loss_type == "reinforce":
        raise ConfigError(f"{key}.rollout_is_batch_normalize",
                          "true with loss_type=reinforce in bypass mode is not implemented (verl normalises each "
                          "micro-batch's weights over all ranks inside the loss); set it to false")
    # verl_async.algos imports torch: only when a bypass_mode loss is asked for
    from verl_async.algos.rollout_rejection import parse_is_threshold, parse_rejection

    try:
        if bc.rollout_rs is not None:
            parse_rejection(bc.rollout_rs, _plain(bc.rollout_rs_threshold))
        if bc.rollout_is is not None:
            parse_is_threshold(_plain(bc.rollout_is_threshold))
    except ValueError as exc:
        name, _, why = str(exc).partition(": ")
        raise ConfigError(f"{key}.{name.split()[0]}", why or str(exc)) from None


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
