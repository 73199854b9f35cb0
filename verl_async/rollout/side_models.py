"""The models the Rollouter runs beside its engines, started from the config: teachers (distillation) and the
reward model. Where they run: their own devices (`distillation.nnodes` > 0, `reward.reward_model.
enable_resource_pool=true`), or beside the engine replicas: on the devices the engines share with the trainer
(`rollout.colocate=true`) or, on CPU, as small CPU actors. Weight syncs never reach them (they are not engines).
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

import ray
from omegaconf import OmegaConf

from verl_async.config.derived import colocated_device_ids, replica_start_timeout_s
from verl_async.config.distillation import DistillationSpec, distillation_spec
from verl_async.teachers.pool import TeacherPool, TeacherReplica
from verl_async.utils.replica_plan import ReplicaPlan
from verl_async.utils.waiting import WaitTimeout, finished_in_turn

START_TIMEOUT_KEY = "rollout.start_timeout_s"


def replica_plan(cfg: Any, own_devices: bool) -> ReplicaPlan:
    """Its own device, or the colocated engines' first device (config checks refuse the other cases)."""
    device = str(cfg.trainer.device)
    return ReplicaPlan(device, None if own_devices else colocated_device_ids(cfg))


def start_actors(cls: type, count_by_key: dict[str, int], args_by_key: dict[str, tuple], kwargs_by_key: dict,
                 plan: ReplicaPlan, timeout_s: float, what: str) -> dict[str, list[Any]]:
    """`count_by_key[k]` actors of `cls(*args, **kwargs)` per key, each loaded within `timeout_s` or all killed."""
    actor_cls = ray.remote(cls)
    tag = uuid.uuid4().hex[:8]
    handles = {key: [actor_cls.options(max_concurrency=1000, name=f"verl_async_{what}_{key}_{i}_{tag}".replace("/", "_"),
                                       **plan.actor_options()).remote(*args_by_key[key], **kwargs_by_key[key])
                     for i in range(count)] for key, count in count_by_key.items()}
    refs = {f"{what} {key!r} replica {i}": h.ready.remote() for key, hs in handles.items() for i, h in enumerate(hs)}
    try:
        for _, ref, left in finished_in_turn(refs, timeout_s):
            ray.get(ref, timeout=left)
    except WaitTimeout as late:
        for hs in handles.values():
            for h in hs:
                ray.kill(h)
        raise TimeoutError(f"{', '.join(late.pending)} did not load its model within {timeout_s:g} s (raise "
                           f"{START_TIMEOUT_KEY} if only slow)") from None
    except BaseException:
        for hs in handles.values():
            for h in hs:
                ray.kill(h)
        raise
    return handles


def teacher_pool(cfg: Any, spec: Optional[DistillationSpec] = None) -> Optional[TeacherPool]:
    """The run's teachers as Ray actors (None without `distillation.enabled`)."""
    if spec is None and not OmegaConf.select(cfg, "distillation.enabled", default=False):
        return None
    spec = spec or distillation_spec(cfg)
    if spec is None:
        return None
    plan = replica_plan(cfg, own_devices=spec.nnodes > 0)
    topk = spec.loss.topk if spec.loss.uses_topk else None
    trust = bool(cfg.actor_rollout_ref.model.trust_remote_code)
    handles = start_actors(
        TeacherReplica, {t.key: t.num_replicas for t in spec.teachers}, {t.key: (t.model_path, plan) for t in spec.teachers},
        {t.key: dict(dtype=t.dtype, topk=topk, max_num_seqs=t.max_num_seqs,
                     max_num_batched_tokens=t.max_num_batched_tokens, trust_remote_code=trust) for t in spec.teachers},
        plan, replica_start_timeout_s(cfg), "teacher")
    return TeacherPool(handles, spec.route, spec.teacher_key, remote=True)


def shutdown(handles: dict[str, list[Any]]) -> None:
    for hs in handles.values():
        for h in hs:
            try:
                ray.kill(h)
            except Exception:  # noqa: BLE001 - already gone
                pass


def judge_rollout_config(cfg: Any, spec: Any) -> dict[str, Any]:
    """The judge's engine settings: reward.reward_model.rollout's serving keys on the native engine."""
    rm_rollout = OmegaConf.to_container(cfg.reward.reward_model.rollout, resolve=True) or {}
    keys = ("dtype", "gpu_memory_utilization", "max_num_batched_tokens", "max_model_len", "max_num_seqs", "seed",
            "enforce_eager", "engine_kwargs", "prompt_length", "response_length", "free_cache_engine")
    out = {k: rm_rollout[k] for k in keys if rm_rollout.get(k) is not None}
    out.update(name="native", tensor_model_parallel_size=1, true_on_policy=False, kv_cache_tokens=None,
               prompt_length=spec.max_input_tokens, response_length=spec.max_new_tokens)
    return out


def reward_model_scorer(cfg: Any, *, manager: Any, rule_scorer: Any, policy_tokenizer: Any) -> Optional[Any]:
    """The run's reward model as the Rollouter's group scorer (None without reward.reward_model.enable), and the
    replicas it started (`.replicas`: classifier actors or judge engines)."""
    from verl_async.config.reward_model import reward_model_spec
    from verl_async.models.builtin import resolve_model_path
    from verl_async.models.loading import load_tokenizer
    from verl_async.config.reward_model import model_kind
    from verl_async.reward_models.models import ClassifierReplica
    from verl_async.reward_models.scorer import RewardModelScorer
    from verl_async.rollout.engine import GenerateRequest, SamplingParams
    from verl_async.rollout.replica import ReplicaSpec, start_replicas

    if not OmegaConf.select(cfg, "reward.reward_model.enable", default=False):
        return None
    spec = reward_model_spec(cfg)
    path = resolve_model_path(spec.model_path)
    kind = model_kind(path, spec.trust_remote_code)
    rm_tokenizer = load_tokenizer(path, trust_remote_code=spec.trust_remote_code)
    plan = replica_plan(cfg, own_devices=spec.own_devices)
    common = dict(manager=manager, rule_scorer=rule_scorer, policy_tokenizer=policy_tokenizer,
                  rm_tokenizer=rm_tokenizer)
    if kind == "discriminative":
        handles = start_actors(ClassifierReplica, {"rm": spec.replicas}, {"rm": (path, plan)},
                               {"rm": dict(dtype=spec.dtype, max_num_seqs=spec.max_num_seqs,
                                           max_num_batched_tokens=spec.max_num_batched_tokens,
                                           trust_remote_code=spec.trust_remote_code)},
                               plan, replica_start_timeout_s(cfg), "reward_model")
        scorer = RewardModelScorer(spec, kind, replicas=handles["rm"], remote=True, **common)
        scorer.actors = handles
        return scorer
    eos = rm_tokenizer.eos_token_id
    sampling = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                              max_tokens=spec.max_new_tokens, stop_token_ids=() if eos is None else (int(eos),),
                              seed=int(cfg.trainer.seed))
    engines = start_replicas(spec.replicas, ReplicaSpec(judge_rollout_config(cfg, spec), path, plan.device,
                                                        trust_remote_code=spec.trust_remote_code,
                                                        shared_devices=plan.pinned),
                             timeout_s=replica_start_timeout_s(cfg))
    scorer = RewardModelScorer(spec, kind, replicas=engines, remote=False,
                               judge_request=lambda rid, ids: GenerateRequest(request_id=rid, prompt_ids=ids,
                                                                              sampling=sampling), **common)
    scorer.actors = {"judge": [e.handle for e in engines]}
    return scorer
