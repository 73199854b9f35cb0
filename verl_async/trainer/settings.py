"""The FSDP2 trainer's view of the Hydra config: every key it reads, read once, checked once.

The worker group and each worker parse the same (resolved, plain-dict) config into
`TrainerSettings`, so a misspelt or out-of-range value fails at `init()` with the full
key path, not deep inside a training step. Key names are verl's
(`actor_rollout_ref.actor.*`, `.ref.*`, `.rollout.*`, `trainer.*`).

A few knobs may change between calls (tests sweep them, a pipeline may schedule them);
`TrainerSettings.with_overrides` accepts those by their actor key name and refuses the
rest (model, FSDP layout, optimizer construction are fixed at init).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from verl_async.distillation_loss import DistillationLoss
from verl_async.algos.logprob import logprob_temperature
from verl_async.algos.policy_losses import POLICY_LOSSES, loss_keys
from verl_async.config.derived import rollout_max_model_len
from verl_async.invariant import attention_span
from verl_async.trainer.lora import LoraSettings
from verl_async.trainer.token_budget import CPU_TOKENS

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LR_SCHEDULERS = ("constant", "cosine")
WORKER_TIMEOUT_S = 1800.0  # config/fully_async_ppo_trainer.yaml's trainer.worker_timeout_s, for configs built without it
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2", "varlen")
_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "fp32": "float32", "float32": "float32"}


def _get(cfg: Mapping[str, Any], path: str, default: Any = dataclasses.MISSING) -> Any:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is dataclasses.MISSING:
                raise KeyError(f"config key {path!r} is missing")
            return default
        node = node[part]
    return node


def _first(*values: Any) -> Any:
    """The first value that is not None (0 is a value)."""
    return next((v for v in values if v is not None), None)


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _positive(path: str, value: Any, *, allow_zero: bool = False) -> int:
    if value is None or isinstance(value, bool) or int(value) != value or value < (0 if allow_zero else 1):
        raise ValueError(f"{path} must be a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}")
    return int(value)


def _budget(path: str, value: Any, device: str) -> Optional[int]:
    """A micro-batch token budget; null: 4096 on CPU, sized to the device's free memory elsewhere (token_budget.py)."""
    if value is None:
        return CPU_TOKENS if device == "cpu" else None
    return _positive(path, value)


def _bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{path} must be true or false, got {value!r}")
    return value


def _choice(path: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{path} must be one of {choices}, got {value!r}")
    return value


def _dtype_name(path: str, value: Any) -> str:
    if value not in _DTYPES:
        raise ValueError(f"{path} must be one of {sorted(_DTYPES)}, got {value!r}")
    return _DTYPES[value]


def _distillation(d: Any) -> Optional[DistillationLoss]:
    """`distillation.*` as the loss reads it (None when not enabled; config/distillation.py checked it)."""
    if not d or not d.get("enabled"):
        return None
    dl = dict(d.get("distillation_loss") or {})
    opt = lambda k: None if dl.get(k) is None else float(dl[k])  # noqa: E731
    return DistillationLoss(
        loss_mode=str(dl.get("loss_mode", "k3")), topk=None if dl.get("topk") is None else int(dl["topk"]),
        use_task_rewards=bool(dl.get("use_task_rewards", True)),
        distillation_loss_coef=float(dl.get("distillation_loss_coef", 1.0)), loss_max_clamp=opt("loss_max_clamp"),
        log_prob_min_clamp=opt("log_prob_min_clamp"), use_policy_gradient=bool(dl.get("use_policy_gradient", False)),
        clip_ratio_low=float(dl.get("clip_ratio_low", 0.2)), clip_ratio_high=float(dl.get("clip_ratio_high", 0.2)))


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    lr_scheduler_type: str
    lr_warmup_steps: int
    lr_warmup_steps_ratio: float
    min_lr_ratio: float
    num_cycles: float
    total_training_steps: int  # -1: not known (then only a warmup-free constant schedule is allowed)


@dataclass(frozen=True)
class RolloutCorrectionSettings:
    enable: bool = False
    level: str = "token"
    mode: str = "truncate"
    lower: Optional[float] = None
    upper: Optional[float] = 2.0
    rs: bool = False
    rs_level: Optional[str] = None
    rs_lower: Optional[float] = None
    rs_upper: Optional[float] = None
    veto_threshold: Optional[float] = None
    veto_rule: str = "old_prob"
    batch_normalize: bool = False

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "RolloutCorrectionSettings":
        """`actor_rollout_ref.actor.rollout_correction` of the full config (worker group and Trainer read it so)."""
        key = "actor_rollout_ref.actor.rollout_correction"
        rc = _get(cfg, key, {}) or {}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(rc) - known
        if unknown:
            raise ValueError(f"{key} has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**dict(rc))

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `verl_async.algos.rollout_correction`."""
        d = dataclasses.asdict(self)
        d.pop("enable")
        return d


def lora_settings(cfg: Mapping[str, Any]) -> Optional[LoraSettings]:
    """verl's `actor_rollout_ref.model.lora_rank` (> 0: LoRA) and the keys beside it; None for full training."""
    m = "actor_rollout_ref.model"
    rank = _positive(f"{m}.lora_rank", _get(cfg, f"{m}.lora_rank", 0) or 0, allow_zero=True)
    if rank == 0:
        return None
    alpha = float(_get(cfg, f"{m}.lora_alpha", 16))
    if not alpha > 0:
        raise ValueError(f"{m}.lora_alpha must be > 0, got {alpha}")
    return LoraSettings(rank=rank, alpha=alpha, target_modules=_get(cfg, f"{m}.target_modules", "all-linear"),
                        exclude_modules=_get(cfg, f"{m}.exclude_modules", None),
                        adapter_path=_get(cfg, f"{m}.lora_adapter_path", None))


def policy_loss_params(cfg: Mapping[str, Any]) -> dict:
    """Every policy loss's own keys (a loss takes those it reads), from verl's places: actor.tau_*,
    actor.policy_loss.* and, for bypass_mode, actor.policy_loss.rollout_correction.* (the clip ratios are
    settings of their own). A key the config leaves out keeps the loss's default (verl's)."""
    a = "actor_rollout_ref.actor"
    places = {"tau_pos": f"{a}.tau_pos", "tau_neg": f"{a}.tau_neg"}
    out = {}
    for mode in POLICY_LOSSES:
        for key in loss_keys(mode):
            if key.startswith("clip_ratio"):
                continue
            path = places.get(key, f"{a}.policy_loss.{key}")
            if mode == "bypass_mode":
                path = f"{a}.policy_loss.rollout_correction.{key}"
            value = _get(cfg, path, None)
            if value is not None:
                out[key] = value
    return out


@dataclass(frozen=True)
class TrainerSettings:
    # placement
    device: str
    nnodes: int
    n_gpus_per_node: int
    node_resource: Optional[str]  # a Ray custom resource marking the trainer's nodes (verl_async/placement.py)
    seed: int
    cpu_threads_per_worker: int  # torch threads of each rank on CPU (several ranks share the cores)
    # model
    model_path: str
    trust_remote_code: bool
    override_config: dict
    custom_chat_template: Optional[str]
    gradient_checkpointing: bool
    use_remove_padding: bool
    attn_implementation: str
    # FSDP
    param_dtype: str
    reduce_dtype: str
    reshard_after_forward: bool
    grad_accum_no_sync: bool  # reduce-scatter once per optimizer step, not per micro-batch (fsdp_worker._grad_sync)
    offload_policy: bool
    param_offload: bool
    optimizer_offload: bool
    ref_param_offload: bool
    # Ulysses sequence parallelism (trainer/ulysses.py): ranks per sequence-parallel group
    ulysses_sequence_parallel_size: int
    # LoRA (trainer/lora.py): None trains every parameter
    lora: Optional[LoraSettings]
    # update
    rollout_n: int
    ppo_mini_batch_size: int  # groups (prompts) per optimizer step; x rollout_n responses
    ppo_micro_batch_size_per_gpu: int
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: Optional[int]  # None until the worker group sizes it to the device (token_budget.py)
    ppo_epochs: int
    shuffle: bool
    grad_clip: Optional[float]
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    loss_agg_mode: str
    loss_mode: str  # policy_loss.loss_mode (verl_async.algos.policy_losses)
    policy_loss: dict  # that loss's own keys (policy_loss_params)
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    need_ref: bool
    rollout_correction: RolloutCorrectionSettings
    optim: OptimSettings
    response_length: Optional[int]  # seq-mean-token-sum-norm divides by it (verl pads responses to it)
    # log-prob recompute (actor: rollout.log_prob_*, reference: ref.log_prob_*)
    temperature: float
    log_prob_micro_batch_size_per_gpu: int
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: Optional[int]
    ref_log_prob_micro_batch_size_per_gpu: int
    ref_log_prob_use_dynamic_bsz: bool
    ref_log_prob_max_token_len_per_gpu: Optional[int]
    # Ray
    worker_timeout_s: float
    max_ckpt_to_keep: Optional[int]
    # torch.compile the per-chunk log-prob/entropy math (verl_async.algos.logprob): actor.use_torch_compile
    # for the actor's forward (training and old log-probs), ref.use_torch_compile (default: the actor's) for the
    # reference model's log-probs. Not the rollout engine's (it has its own log-prob code)
    use_torch_compile: bool = False
    ref_use_torch_compile: bool = False
    # actor.checkpoint.save_contents holds hf_model (verl's name): each checkpoint also gets actor/huggingface/
    # with the weights (config and tokenizer are written there always, for verl_async.model_merger)
    save_hf_model: bool = False
    # true on-policy mode (rollout.true_on_policy): the attention span shared with the native engine
    # (verl_async.invariant), None when off
    true_on_policy_span: Optional[int] = None
    # on-policy distillation (distillation.enabled): verl's distillation loss beside the policy loss, None when off
    distillation: Optional[DistillationLoss] = None
    extra: dict = field(default_factory=dict)

    # knobs that may change after init (by their actor key name)
    RUNTIME_KEYS = (
        "loss_agg_mode", "use_dynamic_bsz", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size_per_gpu",
        "ppo_mini_batch_size", "ppo_epochs", "shuffle", "grad_clip", "clip_ratio_low", "clip_ratio_high",
        "clip_ratio_c", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "use_remove_padding",
        "temperature", "log_prob_micro_batch_size_per_gpu", "log_prob_use_dynamic_bsz",
        "log_prob_max_token_len_per_gpu", "ref_log_prob_max_token_len_per_gpu", "rollout_correction",
        "grad_accum_no_sync", "loss_mode", "policy_loss",
    )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    @property
    def sp(self) -> int:
        return self.ulysses_sequence_parallel_size

    def group_tokens(self, budget: Optional[int]) -> Optional[int]:
        """A per-device token budget as the budget of one micro-batch: a sequence-parallel group holds sp x it (verl)."""
        return None if budget is None else budget * self.sp

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "TrainerSettings":
        """Parse the full (resolved) Hydra config; errors name the key."""
        a = "actor_rollout_ref.actor"
        r = "actor_rollout_ref.rollout"
        ref = "actor_rollout_ref.ref"
        m = "actor_rollout_ref.model"
        g = lambda path, default=dataclasses.MISSING: _get(cfg, path, default)  # noqa: E731

        device = _choice("trainer.device", g("trainer.device", "cpu"), ("cuda", "npu", "cpu"))
        optim_type = g(f"{a}.optim.lr_scheduler_type", None) or g(f"{a}.optim.warmup_style", None) or "constant"
        total_steps = g(f"{a}.optim.total_training_steps", -1)
        if total_steps is None or total_steps <= 0:
            total_steps = g("trainer.total_training_steps", None) or -1
        optim = OptimSettings(
            lr=float(g(f"{a}.optim.lr")),
            weight_decay=float(g(f"{a}.optim.weight_decay", 0.01)),
            betas=tuple(float(b) for b in g(f"{a}.optim.betas", (0.9, 0.999))),  # type: ignore[arg-type]
            eps=float(g(f"{a}.optim.eps", 1e-8)),
            lr_scheduler_type=_choice(f"{a}.optim.lr_scheduler_type", optim_type, LR_SCHEDULERS),
            lr_warmup_steps=int(g(f"{a}.optim.lr_warmup_steps", -1)),
            lr_warmup_steps_ratio=float(g(f"{a}.optim.lr_warmup_steps_ratio", 0.0)),
            min_lr_ratio=float(g(f"{a}.optim.min_lr_ratio", 0.0) or 0.0),
            num_cycles=float(g(f"{a}.optim.num_cycles", 0.5)),
            total_training_steps=int(total_steps),
        )
        if len(optim.betas) != 2:
            raise ValueError(f"{a}.optim.betas must hold two numbers, got {optim.betas!r}")
        if not 0.0 <= optim.min_lr_ratio <= 1.0:
            raise ValueError(f"{a}.optim.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio}")
        rollout_correction = RolloutCorrectionSettings.from_config(cfg)
        loss_mode = _choice(f"{a}.policy_loss.loss_mode", g(f"{a}.policy_loss.loss_mode", "vanilla"),
                            tuple(POLICY_LOSSES))
        policy_loss = policy_loss_params(cfg)
        grad_clip = g(f"{a}.grad_clip", 1.0)
        mp = g(f"{a}.fsdp_config.mixed_precision", {}) or {}
        use_kl_loss = bool(g(f"{a}.use_kl_loss", False))
        true_on_policy = _bool(f"{r}.true_on_policy", g(f"{r}.true_on_policy", False))
        span = None
        if true_on_policy:
            max_len = rollout_max_model_len(g(r))
            if max_len is None:
                raise ValueError(f"{r}.true_on_policy needs {r}.prompt_length and {r}.response_length "
                                 f"(or {r}.max_model_len): the attention span both sides share")
            span = attention_span(max_len)
        compile_asked = g(f"{a}.use_torch_compile", None)  # null: on for CUDA (measured faster), off elsewhere
        if compile_asked is None:  # true on-policy: the eager kernel the engine shares
            compile_asked = device == "cuda" and not true_on_policy
        use_torch_compile = _bool(f"{a}.use_torch_compile", compile_asked)
        ref_compile = g(f"{ref}.use_torch_compile", None)
        settings = cls(
            device=device,
            nnodes=_positive("trainer.nnodes", g("trainer.nnodes", 1)),
            n_gpus_per_node=_positive("trainer.n_gpus_per_node", g("trainer.n_gpus_per_node", 1)),
            node_resource=g("trainer.node_resource", None) or None,
            seed=int(g("trainer.seed", 1)),
            # null: the pipeline fills in the ranks' share of the cores (config/derived.py cpu_threads); 1 without it
            cpu_threads_per_worker=_positive("trainer.cpu_threads_per_worker",
                                             _default(g("trainer.cpu_threads_per_worker", None), 1)),
            model_path=str(g(f"{m}.path")),
            trust_remote_code=bool(g(f"{m}.trust_remote_code", False)),
            override_config=dict(g(f"{m}.override_config", {}) or {}),
            custom_chat_template=g(f"{m}.custom_chat_template", None),
            gradient_checkpointing=bool(g(f"{m}.enable_gradient_checkpointing", False)),
            use_remove_padding=bool(g(f"{m}.use_remove_padding", True)),
            attn_implementation=_choice(f"{m}.attn_implementation", g(f"{m}.attn_implementation", "auto") or "auto",
                                        ATTN_IMPLEMENTATIONS),
            param_dtype=_dtype_name(f"{a}.fsdp_config.mixed_precision.param_dtype", mp.get("param_dtype", "bf16")),
            reduce_dtype=_dtype_name(f"{a}.fsdp_config.mixed_precision.reduce_dtype", mp.get("reduce_dtype", "fp32")),
            reshard_after_forward=bool(g(f"{a}.fsdp_config.reshard_after_forward", True)),
            grad_accum_no_sync=bool(g(f"{a}.fsdp_config.grad_accum_no_sync", True)),
            offload_policy=bool(g(f"{a}.fsdp_config.offload_policy", False)),
            param_offload=bool(g(f"{a}.fsdp_config.param_offload", False)),
            optimizer_offload=bool(g(f"{a}.fsdp_config.optimizer_offload", False)),
            ref_param_offload=bool(g(f"{ref}.fsdp_config.param_offload", True)),
            ulysses_sequence_parallel_size=_positive(f"{a}.ulysses_sequence_parallel_size",
                                                     g(f"{a}.ulysses_sequence_parallel_size", 1)),
            lora=lora_settings(cfg),
            rollout_n=_positive(f"{r}.n", g(f"{r}.n", 1)),
            ppo_mini_batch_size=_positive(f"{a}.ppo_mini_batch_size", g(f"{a}.ppo_mini_batch_size")),
            ppo_micro_batch_size_per_gpu=_positive(f"{a}.ppo_micro_batch_size_per_gpu",
                                                   g(f"{a}.ppo_micro_batch_size_per_gpu", 1)),
            use_dynamic_bsz=bool(g(f"{a}.use_dynamic_bsz", False)),
            ppo_max_token_len_per_gpu=_budget(f"{a}.ppo_max_token_len_per_gpu",
                                              g(f"{a}.ppo_max_token_len_per_gpu", None), device),
            ppo_epochs=_positive(f"{a}.ppo_epochs", g(f"{a}.ppo_epochs", 1)),
            shuffle=bool(g(f"{a}.shuffle", False)),
            grad_clip=None if grad_clip is None or float(grad_clip) <= 0 else float(grad_clip),
            clip_ratio_low=float(_first(g(f"{a}.clip_ratio_low", None), g(f"{a}.clip_ratio", 0.2))),
            clip_ratio_high=float(_first(g(f"{a}.clip_ratio_high", None), g(f"{a}.clip_ratio", 0.2))),
            clip_ratio_c=float(g(f"{a}.clip_ratio_c", 3.0)),
            loss_agg_mode=_choice(f"{a}.loss_agg_mode", g(f"{a}.loss_agg_mode", "token-mean"), LOSS_AGG_MODES),
            loss_mode=loss_mode,
            policy_loss=policy_loss,
            entropy_coeff=float(g(f"{a}.entropy_coeff", 0.0)),
            use_kl_loss=use_kl_loss,
            kl_loss_coef=float(g(f"{a}.kl_loss_coef", 0.001)),
            kl_loss_type=_choice(f"{a}.kl_loss_type", g(f"{a}.kl_loss_type", "low_var_kl"), KL_TYPES),
            need_ref=use_kl_loss or bool(g("algorithm.use_kl_in_reward", False)),
            rollout_correction=rollout_correction,
            optim=optim,
            response_length=(int(g(f"{r}.response_length")) if g(f"{r}.response_length", None) else None),
            # greedy rollouts (do_sample=false) carry T=1 log-probs: recompute those
            temperature=logprob_temperature(float(g(f"{r}.temperature", 1.0)), bool(g(f"{r}.do_sample", True))),
            log_prob_micro_batch_size_per_gpu=_positive(
                f"{r}.log_prob_micro_batch_size_per_gpu", g(f"{r}.log_prob_micro_batch_size_per_gpu", 8)),
            log_prob_use_dynamic_bsz=bool(g(f"{r}.log_prob_use_dynamic_bsz", False)),
            log_prob_max_token_len_per_gpu=_budget(
                f"{r}.log_prob_max_token_len_per_gpu", g(f"{r}.log_prob_max_token_len_per_gpu", None), device),
            ref_log_prob_micro_batch_size_per_gpu=_positive(
                f"{ref}.log_prob_micro_batch_size_per_gpu", g(f"{ref}.log_prob_micro_batch_size_per_gpu", 8)),
            ref_log_prob_use_dynamic_bsz=bool(g(f"{ref}.log_prob_use_dynamic_bsz", False)),
            ref_log_prob_max_token_len_per_gpu=_budget(
                f"{ref}.log_prob_max_token_len_per_gpu", g(f"{ref}.log_prob_max_token_len_per_gpu", None), device),
            worker_timeout_s=float(g("trainer.worker_timeout_s", WORKER_TIMEOUT_S)),
            max_ckpt_to_keep=g("trainer.max_actor_ckpt_to_keep", None),
            use_torch_compile=use_torch_compile,
            ref_use_torch_compile=(use_torch_compile if ref_compile is None
                                   else _bool(f"{ref}.use_torch_compile", ref_compile)),
            save_hf_model="hf_model" in list(g(f"{a}.checkpoint.save_contents", []) or []),
            true_on_policy_span=span,
            distillation=_distillation(g("distillation", None)),
        )
        settings.check()
        return settings

    def check(self) -> None:
        """Cross-key checks (also re-run after runtime overrides)."""
        a = "actor_rollout_ref.actor"
        if self.temperature < 0:
            raise ValueError(f"actor_rollout_ref.rollout.temperature must be >= 0, got {self.temperature}")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"{a}.clip_ratio_c must be > 1 (dual clip), got {self.clip_ratio_c}")
        _choice(f"{a}.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _choice(f"{a}.policy_loss.loss_mode", self.loss_mode, tuple(POLICY_LOSSES))
        _choice(f"{a}.kl_loss_type", self.kl_loss_type, KL_TYPES)
        o = self.optim
        if (o.lr_scheduler_type == "cosine" or (o.lr_warmup_steps <= 0 and o.lr_warmup_steps_ratio > 0)) \
                and o.total_training_steps <= 0:
            raise ValueError(
                f"{a}.optim.total_training_steps (or trainer.total_training_steps) must be > 0 for "
                f"lr_scheduler_type={o.lr_scheduler_type!r} with lr_warmup_steps_ratio={o.lr_warmup_steps_ratio}"
            )
        if self.use_kl_loss and not self.need_ref:
            raise AssertionError("unreachable: use_kl_loss implies a reference model")
        if self.sp > 1:
            if self.world_size % self.sp:
                raise ValueError(f"{a}.ulysses_sequence_parallel_size={self.sp} does not divide the trainer's "
                                 f"{self.world_size} ranks")
            if not self.use_remove_padding:
                raise ValueError(f"{a}.ulysses_sequence_parallel_size={self.sp} needs packed rows: "
                                 "actor_rollout_ref.model.use_remove_padding=true")
            if self.true_on_policy_span is not None:
                raise ValueError(f"{a}.ulysses_sequence_parallel_size={self.sp} cannot run with "
                                 "actor_rollout_ref.rollout.true_on_policy (the engine's attention is not split)")
        if self.true_on_policy_span is not None and self.use_torch_compile:
            raise ValueError(f"{a}.use_torch_compile=true cannot run with actor_rollout_ref.rollout.true_on_policy "
                             f"(compiled log-prob kernels change the arithmetic); set it to false")

    def with_overrides(self, overrides: Mapping[str, Any]) -> "TrainerSettings":
        unknown = set(overrides) - set(self.RUNTIME_KEYS)
        if unknown:
            raise ValueError(f"cannot change {sorted(unknown)} after init; runtime keys: {list(self.RUNTIME_KEYS)}")
        overrides = dict(overrides)
        rc = overrides.get("rollout_correction")
        if isinstance(rc, Mapping):  # partial update of the nested section
            overrides["rollout_correction"] = dataclasses.replace(self.rollout_correction, **dict(rc))
        if isinstance(overrides.get("policy_loss"), Mapping):  # partial update of the loss keys
            overrides["policy_loss"] = {**self.policy_loss, **dict(overrides["policy_loss"])}
        updated = dataclasses.replace(self, **overrides)
        if updated.use_kl_loss and not self.need_ref:
            raise ValueError("actor_rollout_ref.actor.use_kl_loss=true needs the reference model, which was not "
                             "built at init (use_kl_loss and algorithm.use_kl_in_reward were both false)")
        updated.check()
        return updated

    def warmup_steps(self) -> int:
        o = self.optim
        if o.lr_warmup_steps > 0:
            return o.lr_warmup_steps
        return int(o.lr_warmup_steps_ratio * max(o.total_training_steps, 0))
