"""`reward.reward_model.*` (verl's reward-model keys) read and checked; the runtime is verl_async/reward_models/.

verl's meaning: with `enable`, the model at `model_path` scores every response. A discriminative model (an HF
`*ForSequenceClassification` folder) gives the score itself (verl: the last label's raw logit over the RM's chat
template of prompt + response); verl's generative reward model is a custom reward function posting to the RM
server, here a judge the run serves itself (`judge.*`, verl_async's keys). `enable_resource_pool=true` gives it
`n_gpus_per_node x nnodes` devices of its own; false puts it beside the engine replicas (verl: colocated).
verl_async's own: `use_task_rewards` adds the rule reward (the reward manager's score) and `reward_model_coef`
weighs the model's: reward = [rule] + reward_model_coef x model score.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from verl_async.config.distillation import INFERENCE_KEYS, beside_engines_problem
from verl_async.config.errors import ConfigError

_RM = "reward.reward_model"
# verl's reward-model RolloutConfig adds these to the keys a teacher's inference holds
ROLLOUT_KEYS = INFERENCE_KEYS + ("dtype", "max_num_seqs")
SERVING_NAMES = ("native", "vllm", "sglang")  # the judge always runs on verl_async's native engine
DEFAULT_JUDGE_TEMPLATE = (
    "Rate how well the response answers the question, from {min_score:g} (wrong or useless) to {max_score:g} "
    "(correct and complete).\n\nQuestion:\n{prompt}\n\nReference answer (may be empty):\n{ground_truth}\n\n"
    "Response:\n{response}\n\nReply with the rating only, a single number.")


@dataclass(frozen=True)
class RewardModelSpec:
    model_path: str
    own_devices: bool  # enable_resource_pool
    replicas: int  # own devices: n_gpus_per_node x nnodes; beside the engines: 1
    dtype: str
    max_num_seqs: int  # a batch (discriminative) / the judge engine's concurrent sequences
    max_num_batched_tokens: int
    max_input_tokens: int  # the longest RM input (discriminative) / judge prompt
    max_new_tokens: int  # the judge's answer
    temperature: float
    top_p: float
    top_k: int
    use_task_rewards: bool
    reward_model_coef: float
    prompt_template: str
    score_pattern: str
    min_score: float
    max_score: float
    trust_remote_code: bool = False


def reward_model_spec(cfg: DictConfig) -> Optional[RewardModelSpec]:
    """The reward model of `reward.reward_model.*`, checked (ConfigError naming the key); None when disabled."""
    rm = cfg.reward.reward_model
    if not rm.enable:
        return None
    if rm.model_path is None:
        raise ConfigError(f"{_RM}.model_path", "required with reward.reward_model.enable=true (an HF folder or id: "
                                               "*ForSequenceClassification to score, or an instruct model as judge)")
    rollout = dict(OmegaConf.to_container(rm.rollout, resolve=True) or {})
    for key in rollout:
        if key not in ROLLOUT_KEYS and key != "_target_":
            raise ConfigError(f"{_RM}.rollout.{key}", "unknown key (verl's RolloutConfig keys)")
    name = rollout.get("name", "native")
    if name not in SERVING_NAMES:
        raise ConfigError(f"{_RM}.rollout.name", f"{name}: not a reward-model server here; use one of: "
                                                 f"{', '.join(SERVING_NAMES)} (the judge runs on the native engine)")
    for key in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
        if int(rollout.get(key) or 1) != 1:
            raise ConfigError(f"{_RM}.rollout.{key}", f"{rollout[key]}: a reward-model replica runs on one device "
                                                      "here; set it to 1 (more devices: more replicas)")
    replicas = 1
    if rm.enable_resource_pool:
        replicas = int(rm.n_gpus_per_node) * int(rm.nnodes)
        if replicas < 1:
            raise ConfigError(f"{_RM}.nnodes", f"enable_resource_pool=true needs devices: n_gpus_per_node x nnodes = "
                                               f"{rm.n_gpus_per_node} x {rm.nnodes}")
    else:
        problem = beside_engines_problem(cfg, f"{_RM}.enable_resource_pool", "false puts the reward model; a model")
        if problem is not None:
            raise problem
    judge = rm.judge
    template = judge.prompt_template or DEFAULT_JUDGE_TEMPLATE
    if "{response}" not in template:
        raise ConfigError(f"{_RM}.judge.prompt_template", "must hold {response} (and may hold {prompt}, "
                                                          "{ground_truth}, {min_score}, {max_score})")
    try:
        pattern = re.compile(judge.score_pattern)
    except re.error as exc:
        raise ConfigError(f"{_RM}.judge.score_pattern", f"not a regular expression: {exc}") from None
    if pattern.groups < 1:
        raise ConfigError(f"{_RM}.judge.score_pattern", "needs a group around the number, e.g. '(\\d+)'")
    if not judge.min_score < judge.max_score:
        raise ConfigError(f"{_RM}.judge.max_score", f"must be > judge.min_score ({judge.min_score})")
    prompt_length = int(rollout.get("prompt_length") or 2048)
    return RewardModelSpec(
        model_path=str(rm.model_path), own_devices=bool(rm.enable_resource_pool), replicas=replicas,
        dtype=str(rollout.get("dtype") or "bfloat16"), max_num_seqs=int(rollout.get("max_num_seqs") or 64),
        max_num_batched_tokens=int(rollout.get("max_num_batched_tokens") or 8192), max_input_tokens=prompt_length,
        max_new_tokens=int(rollout.get("response_length") or 64),
        temperature=float(rollout.get("temperature") or 0.0), top_p=float(rollout.get("top_p") or 1.0),
        top_k=int(rollout.get("top_k") if rollout.get("top_k") is not None else -1),
        use_task_rewards=bool(rm.use_task_rewards), reward_model_coef=float(rm.reward_model_coef),
        prompt_template=template, score_pattern=str(judge.score_pattern), min_score=float(judge.min_score),
        max_score=float(judge.max_score), trust_remote_code=bool(cfg.actor_rollout_ref.model.trust_remote_code))


def check_reward_model(cfg: Any) -> None:
    reward_model_spec(cfg)


def model_kind(model_path: str, trust_remote_code: bool = False) -> str:
    """"discriminative" (a *ForSequenceClassification) or "generative" (a causal LM: a judge), from its config."""
    from verl_async.models.builtin import resolve_model_path
    from verl_async.models.loading import load_hf_config

    config = load_hf_config(resolve_model_path(model_path), trust_remote_code=trust_remote_code)
    archs = list(getattr(config, "architectures", None) or [])
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "discriminative"
    if any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
        return "generative"
    raise ValueError(f"reward.reward_model.model_path={model_path!r}: architectures {archs or 'unknown'} are neither "
                     "a sequence classifier (a discriminative reward model) nor a causal LM (a judge)")
