"""`distillation.*` (verl's on-policy distillation keys) read and checked: the teachers and the loss.

verl's rules, with its messages where it has one (verl/workers/config/distillation.py): `teacher_model` is the
single teacher (it routes every row, key "default", and takes the whole pool); naming others drops it; each
named teacher needs `key` (the value of the row's `teacher_key` field it serves) and `model_path`; keys are
unique; with a pool (`nnodes` > 0) the teachers' replicas fill it exactly; k1 is refused as a direct loss.
verl_async's own: `nnodes=0` puts the teachers beside the engine replicas (one replica each unless
`num_replicas` says more); a teacher replica is one device (tensor/data/pipeline parallel sizes stay 1);
top-k losses need the FSDP2 trainer (it reads the student's logits). The runtime is verl_async/teachers/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from verl_async.distillation_loss import DistillationLoss
from verl_async.config.errors import ConfigError

_D = "distillation"
_SINGLE = "teacher_model"
TEACHER_KEYS = ("key", "model_path", "num_replicas", "inference")
# verl's RolloutConfig keys a teacher's `inference` may hold; the teachers here read dtype, max_num_seqs,
# max_num_batched_tokens and max_model_len (an HF forward: the serving keys have nothing to act on)
INFERENCE_KEYS = (
    "name", "mode", "nnodes", "n_gpus_per_node", "temperature", "top_k", "top_p", "full_determinism", "seed",
    "prompt_length", "response_length", "dtype", "gpu_memory_utilization", "ignore_eos", "enforce_eager",
    "cudagraph_capture_sizes", "free_cache_engine", "tensor_model_parallel_size", "data_parallel_size",
    "expert_parallel_size", "pipeline_model_parallel_size", "max_num_batched_tokens", "max_model_len", "max_num_seqs",
    "enable_chunked_prefill", "enable_prefix_caching", "logprobs_mode", "scheduling_policy", "load_format",
    "layered_summon", "disable_log_stats", "do_sample", "n", "multi_stage_wake_up", "engine_kwargs", "limit_images",
    "skip_tokenizer_init", "quantization", "quantization_config_file", "mtp", "disaggregation", "calculate_log_probs",
)
_ONE_DEVICE = ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size",
               "expert_parallel_size")


@dataclass(frozen=True)
class TeacherSpec:
    name: str  # its entry under distillation.teacher_models
    key: str  # the teacher_key value it serves ("default": the single teacher, every row)
    model_path: str
    num_replicas: int
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: Optional[int]


@dataclass(frozen=True)
class DistillationSpec:
    teachers: Tuple[TeacherSpec, ...]
    teacher_key: str  # the row field (extra_info or the row's own: data_source) that picks a teacher
    loss: DistillationLoss
    nnodes: int  # 0: beside the engine replicas
    n_gpus_per_node: int

    @property
    def single(self) -> bool:
        return len(self.teachers) == 1

    def route(self, value: Any) -> str:
        """The teacher key a row with `teacher_key` field `value` goes to (verl's `_resolve_teacher_key`)."""
        if self.single:
            return self.teachers[0].key
        if value is None:
            raise ValueError(f"Routing key is required for multi-teacher distillation (configured via "
                             f"distillation.teacher_key={self.teacher_key!r}).")
        keys = sorted(t.key for t in self.teachers)
        if str(value) not in keys:
            raise ValueError(f"No teacher configured for routing key {value!r}. Configured teachers: {keys}.")
        return str(value)


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def loss_from_config(cfg: Any) -> DistillationLoss:
    d = cfg.distillation.distillation_loss
    return DistillationLoss(loss_mode=str(d.loss_mode), topk=None if d.topk is None else int(d.topk),
                            use_task_rewards=bool(d.use_task_rewards),
                            distillation_loss_coef=float(d.distillation_loss_coef),
                            loss_max_clamp=None if d.loss_max_clamp is None else float(d.loss_max_clamp),
                            log_prob_min_clamp=None if d.log_prob_min_clamp is None else float(d.log_prob_min_clamp),
                            use_policy_gradient=bool(d.use_policy_gradient), clip_ratio_low=float(d.clip_ratio_low),
                            clip_ratio_high=float(d.clip_ratio_high))


def distillation_spec(cfg: DictConfig) -> Optional[DistillationSpec]:
    """The teachers and the loss of `distillation.*`, checked (ConfigError naming the key); None when disabled."""
    dist = cfg.distillation
    if not dist.enabled:
        return None
    loss = loss_from_config(cfg)
    lk = f"{_D}.distillation_loss"
    if not loss.use_policy_gradient and loss.loss_mode == "k1":
        raise ConfigError(f"{lk}.loss_mode", "Directly backpropagating k1 loss is incorrect since gradient of k1 loss "
                                             "wrt model weights does not depend on teacher log probabilities.")
    if loss.uses_topk:
        if loss.topk is None:
            raise ConfigError(f"{lk}.topk", "topk must be specified when use_topk is True.")
        if cfg.actor_rollout_ref.actor.get("ulysses_sequence_parallel_size", 1) > 1:
            raise ConfigError(f"{lk}.loss_mode", "forward_kl_topk with Ulysses sequence parallelism is not implemented "
                              "(the student's top-k would be gathered over the sp group); use "
                              "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 or a per-token loss_mode")
        if cfg.actor_rollout_ref.actor.strategy == "megatron":
            raise ConfigError(f"{lk}.loss_mode", "forward_kl_topk needs the student's logits, which the Megatron "
                                                 "trainer does not expose here; use the FSDP2 trainer or a KL estimator "
                                                 "mode (k3, k2, ...)")
    entries: Dict[str, Any] = dict(_plain(dist.teacher_models) or {})
    if len(entries) > 1:
        entries.pop(_SINGLE, None)  # verl: naming other teachers drops the default single one
    if not entries:
        raise ConfigError(f"{_D}.teacher_models", "no teacher: set distillation.teacher_models.teacher_model."
                                                  "model_path (or name teachers NAME with key and model_path)")
    teachers = tuple(_teacher(name, entry, len(entries) == 1, cfg) for name, entry in entries.items())
    keys = [t.key for t in teachers]
    for key in keys:
        if keys.count(key) > 1:
            raise ConfigError(f"{_D}.teacher_models", f"Duplicate teacher key {key} found in teacher models.")
    nnodes, per_node = int(dist.nnodes), int(dist.n_gpus_per_node)
    if nnodes > 0:
        pool = nnodes * per_node
        if len(teachers) == 1 and teachers[0].num_replicas == 0:  # the single teacher takes the whole pool
            teachers = (TeacherSpec(**{**teachers[0].__dict__, "num_replicas": pool}),)
        used = sum(t.num_replicas for t in teachers)
        if used != pool:
            raise ConfigError(f"{_D}.nnodes", f"Sum of teacher (num_replicas * per_replica_world_size) ({used}) must "
                                              f"match the distillation resource pool size (self.n_gpus_per_node="
                                              f"{per_node} * self.nnodes={nnodes} = {pool}).")
    else:  # beside the engines: at least one replica each
        teachers = tuple(TeacherSpec(**{**t.__dict__, "num_replicas": max(1, t.num_replicas)}) for t in teachers)
    return DistillationSpec(teachers=teachers, teacher_key=str(dist.teacher_key), loss=loss, nnodes=nnodes,
                            n_gpus_per_node=per_node)


def _teacher(name: str, entry: Any, single: bool, cfg: DictConfig) -> TeacherSpec:
    base = f"{_D}.teacher_models.{name}"
    if not isinstance(entry, dict):
        raise ConfigError(base, f"expected a mapping of keys ({', '.join(TEACHER_KEYS)}), got {entry!r}")
    for key in entry:
        if key not in TEACHER_KEYS and key != "_target_":
            raise ConfigError(f"{base}.{key}", f"unknown key (a teacher has {', '.join(TEACHER_KEYS)})")
    inference = dict(entry.get("inference") or {})
    for key in inference:
        if key not in INFERENCE_KEYS and key != "_target_":
            raise ConfigError(f"{base}.inference.{key}", "unknown key (verl's RolloutConfig keys)")
    for key in _ONE_DEVICE:
        if int(inference.get(key) or 1) != 1:
            raise ConfigError(f"{base}.inference.{key}", f"{inference[key]}: a teacher replica runs on one device "
                                                         "here (an HF forward pass); set it to 1 and raise num_replicas")
    if entry.get("model_path") is None:
        raise ConfigError(f"{base}.model_path", "model_path must be specified for distillation teacher model config.")
    key = "default" if single else entry.get("key")
    if key is None:
        raise ConfigError(f"{base}.key", "key must be specified for distillation teacher model config.")
    replicas = entry.get("num_replicas")
    if replicas is None or int(replicas) < 0:
        raise ConfigError(f"{base}.num_replicas", "num_replicas must be specified for distillation teacher model "
                                                  "config.")
    rollout = cfg.actor_rollout_ref.rollout
    prompt = int(inference.get("prompt_length") or rollout.prompt_length)
    response = int(inference.get("response_length") or rollout.response_length)
    max_model_len = inference.get("max_model_len")
    if max_model_len is not None and prompt + response + 1 > int(max_model_len):
        raise ConfigError(f"{base}.inference.max_model_len",
                          "Distillation teacher inference requires room for the student prompt, the full student "
                          f"response, and one generated token, but got student_prompt_length={prompt}, "
                          f"student_response_length={response}, required_context_len={prompt + response + 1}, "
                          f"max_model_len={max_model_len}.")
    return TeacherSpec(name=name, key=str(key), model_path=str(entry["model_path"]), num_replicas=int(replicas),
                       dtype=str(inference.get("dtype") or rollout.dtype),
                       max_num_seqs=int(inference.get("max_num_seqs") or 64),
                       max_num_batched_tokens=int(inference.get("max_num_batched_tokens") or 8192),
                       max_model_len=None if max_model_len is None else int(max_model_len))


def beside_engines_problem(cfg: DictConfig, key: str, what: str) -> Optional[ConfigError]:
    """A model placed beside the engine replicas needs their devices known: colocated with the trainer, or CPU."""
    if cfg.trainer.device == "cpu" or cfg.rollout.colocate:
        return None
    return ConfigError(key, f"{what} beside the engine replicas needs rollout.colocate=true on an accelerator (the "
                            "devices the engines share with the trainer); with separate engine devices give it devices "
                            "of its own")


def check_distillation(cfg: DictConfig) -> None:
    spec = distillation_spec(cfg)
    if spec is not None and spec.nnodes == 0:
        problem = beside_engines_problem(cfg, f"{_D}.nnodes", "0 puts the teachers; a teacher")
        if problem is not None:
            raise problem


def _local_model(key: str, path: str) -> Optional[str]:
    """The local folder of a model path (None: an HF id, left to the hub); a missing local one is an error."""
    import os

    from verl_async.models.builtin import resolve_model_path
    from verl_async.models.names import is_builtin, is_gguf

    if is_builtin(path) or is_gguf(path):
        try:
            return resolve_model_path(path)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(key, str(exc)) from None
    expanded = os.path.expanduser(path)
    if path.startswith(("/", ".", "~")) or os.path.exists(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise ConfigError(key, f"{path}: no model folder there (no config.json)")
        return expanded
    return None


def preflight_side_models(cfg: DictConfig, tokenizer: Any) -> None:
    """The dry run's look at the teachers' and the reward model's folders: they exist, a teacher shares the
    student's vocabulary (it scores the student's token ids), a reward model is a classifier or a causal LM."""
    from verl_async.models.loading import load_hf_config

    spec = distillation_spec(cfg)
    for teacher in spec.teachers if spec is not None else ():
        key = f"{_D}.teacher_models.{teacher.name}.model_path"
        folder = _local_model(key, teacher.model_path)
        if folder is None:
            continue
        vocab = int(getattr(load_hf_config(folder), "vocab_size", 0) or 0)
        if vocab < len(tokenizer):
            raise ConfigError(key, f"{teacher.model_path}: a vocabulary of {vocab} tokens, fewer than the student's "
                                   f"{len(tokenizer)}; a teacher must share the student's tokenizer")
    if OmegaConf.select(cfg, "reward.reward_model.enable", default=False):
        key = "reward.reward_model.model_path"
        folder = _local_model(key, str(cfg.reward.reward_model.model_path))
        if folder is not None:
            from verl_async.config.reward_model import model_kind

            try:
                model_kind(folder)
            except ValueError as exc:
                raise ConfigError(key, str(exc).split(": ", 1)[-1]) from None
