"""Rules that involve more than one key, or the file system.

Each check takes the typed config and raises ConfigError naming the key to fix. They
run in the order written, after types and per-key rules (schema.py) have passed, so a
check may assume every value has its declared type. Register a new one with @check.
Checks may fill values that verl derives (e.g. the per-GPU micro-batch from verl's
global one); they say so in their docstring.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl_async.config import derived
from verl_async.config.errors import ConfigError
from verl_async.config.fault_specs import FaultSpecError, parse_fail_replicas, parse_fail_trainer
from verl_async.config.verl09 import EP_TRAIN
from verl_async.models.names import BUILTIN_MODELS, is_gguf
from verl_async.utils.tracking import logger_problem

Check = Callable[[DictConfig], None]
CHECKS: List[Check] = []

BUILTIN_PREFIX = "builtin://"
_A = "actor_rollout_ref"


def check(fn: Check) -> Check:
    CHECKS.append(fn)
    return fn


# --------------------------------------------------------------------------- helpers
def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~"))


def _has_scheme(path: str) -> bool:
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path) is not None


def _file_list(key: str, value: Any, *, required: bool) -> List[str]:
    if value is None or (isinstance(value, (list, ListConfig)) and len(value) == 0):
        if required:
            raise ConfigError(key, "no file given (a parquet path, builtin://NAME, or a list of them)")
        return []
    items = list(value) if isinstance(value, (list, ListConfig)) else [value]
    for item in items:
        if not isinstance(item, str) or not item:
            raise ConfigError(key, f"expected a file path or a list of them, got {item!r}")
    return items


def _check_files(key: str, value: Any, *, required: bool) -> None:
    for path in _file_list(key, value, required=required):
        if path.startswith(BUILTIN_PREFIX):
            if not path[len(BUILTIN_PREFIX):]:
                raise ConfigError(key, f"{path!r} names no built-in dataset (builtin://NAME)")
            continue
        if _has_scheme(path):
            raise ConfigError(key, f"{path!r}: remote paths are not supported; copy the file to local disk")
        if not os.path.exists(os.path.expanduser(path)):
            where = "" if os.path.isabs(os.path.expanduser(path)) else f" (relative to {os.getcwd()})"
            raise ConfigError(key, f"no such file: {path}{where}")


def _check_local_dir(key: str, path: str) -> None:
    full = os.path.expanduser(path)
    if not os.path.exists(full):
        raise ConfigError(key, f"no such folder: {path}")
    if not os.path.isdir(full):
        raise ConfigError(key, f"{path} is a file; expected a model folder")


# --------------------------------------------------------------------------- strategy
@check
def strategy_sections(cfg: DictConfig) -> None:
    if cfg.actor_rollout_ref.ref.strategy != cfg.actor_rollout_ref.actor.strategy:
        raise ConfigError("actor_rollout_ref.ref.strategy", "must equal actor_rollout_ref.actor.strategy")


@check
def unsupported_features(cfg: DictConfig) -> None:
    """verl features verl_async does not implement, set on: refused, saying what to do instead."""
    reward_model = ("verl's older reward-model layout is not supported here; use verl 0.9's keys: reward.reward_model."
                    "enable=true reward.reward_model.model_path=... (docs/verl_v1.md)")
    refusals = {
        "reward_model.enable": (cfg.reward_model.enable, reward_model),
        "reward.reward_manager.source": (
            cfg.reward.reward_manager.source == "importlib",
            "importlib (a custom reward manager class) is not supported; use reward.reward_manager.name=naive|dapo "
            "with a reward.custom_reward_function"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise ConfigError(key, why)


@check
def no_expert_parallelism(cfg: DictConfig) -> None:
    """The Megatron trainer converts dense models only: expert parallelism would have no experts to split."""
    if cfg.actor_rollout_ref.actor.strategy != "megatron":
        return
    for role in ("actor", "ref"):
        m = cfg.actor_rollout_ref[role].megatron
        for name, neutral in (("expert_model_parallel_size", (1,)), ("expert_tensor_parallel_size", (None, 1))):
            if m[name] not in neutral:
                raise ConfigError(f"actor_rollout_ref.{role}.megatron.{name}", f"{m[name]}: {EP_TRAIN}")


@check
def sequence_parallelism(cfg: DictConfig) -> None:
    """Ulysses sequence parallelism (FSDP2, trainer/ulysses.py): packed rows, a varlen attention kernel, one size
    for the actor and the reference model. Megatron splits sequences with context parallelism instead."""
    arr = cfg.actor_rollout_ref
    size = arr.actor.ulysses_sequence_parallel_size
    if arr.actor.strategy == "megatron":
        for role in ("actor", "ref"):
            if arr[role].ulysses_sequence_parallel_size != 1:
                raise ConfigError(f"{_A}.{role}.ulysses_sequence_parallel_size",
                                  f"{arr[role].ulysses_sequence_parallel_size}: Ulysses is the FSDP2 trainer's; "
                                  f"Megatron splits sequences with {_A}.actor.megatron.context_parallel_size")
        return
    if arr.ref.ulysses_sequence_parallel_size != size:
        raise ConfigError(f"{_A}.ref.ulysses_sequence_parallel_size",
                          f"{arr.ref.ulysses_sequence_parallel_size}: the reference model runs on the actor's ranks "
                          f"with its layout; set it to {size} (actor_rollout_ref.actor.ulysses_sequence_parallel_size)")
    if size == 1:
        return
    key = f"{_A}.actor.ulysses_sequence_parallel_size"
    if not arr.model.use_remove_padding:
        raise ConfigError(key, f"{size} needs packed rows: set {_A}.model.use_remove_padding=true (as verl does)")
    if arr.model.attn_implementation in ("sdpa", "eager"):
        raise ConfigError(key, f"{size} needs a varlen attention kernel; {_A}.model.attn_implementation="
                               f"{arr.model.attn_implementation} has none (use auto, varlen or flash_attention_2)")
    if arr.rollout.get("true_on_policy"):
        raise ConfigError(key, f"{size} cannot run with {_A}.rollout.true_on_policy (its attention kernel is the "
                               "engine's, unsplit)")


@check
def ray_py_executable(cfg: DictConfig) -> None:
    """verl's runtime_env.py_executable starts every Ray worker: a command that is not there would fail in each."""
    command = (cfg.ray_init.runtime_env or {}).get("py_executable")
    if command is None:
        return
    import shlex
    import shutil

    words = shlex.split(str(command))
    if not words or shutil.which(os.path.expanduser(words[0])) is None:
        verl_key = "ray_kwargs.ray_init.runtime_env.py_executable"
        set_there = (cfg.ray_kwargs.ray_init.runtime_env or {}).get("py_executable") is not None
        raise ConfigError(verl_key if set_there else "ray_init.runtime_env.py_executable",
                          f"{command!r}: {words[0] if words else 'an empty command'} is not an executable on PATH "
                          "(Ray starts every worker with it); set it to null for this Python")


@check
def lora(cfg: DictConfig) -> None:
    """LoRA (trainer/lora.py) trains with the FSDP2 trainer, on the model's own kernels."""
    arr = cfg.actor_rollout_ref
    key = f"{_A}.model.lora_rank"
    if arr.model.lora_rank == 0:
        if arr.model.lora_adapter_path is not None:
            raise ConfigError(f"{_A}.model.lora_adapter_path", f"{arr.model.lora_adapter_path}: a LoRA adapter needs "
                                                               f"{key} > 0 (its rank)")
        return
    if arr.actor.strategy == "megatron":
        raise ConfigError(key, f"{arr.model.lora_rank}: LoRA is not implemented in the Megatron trainer; use "
                               f"{_A}.actor.strategy=fsdp2 (the default config)")
    if arr.rollout.get("true_on_policy"):
        raise ConfigError(key, f"{arr.model.lora_rank}: cannot run with {_A}.rollout.true_on_policy (its batch-"
                               "invariant kernels replace the linear layers LoRA adapts)")
    path = arr.model.lora_adapter_path
    if path is not None and not os.path.isfile(os.path.join(os.path.expanduser(path), "adapter_config.json")):
        raise ConfigError(f"{_A}.model.lora_adapter_path", f"{path}: no adapter_config.json there (a peft adapter "
                                                           "folder, e.g. a checkpoint's actor/huggingface/lora_adapter)")


# --------------------------------------------------------------------------- algorithm
@check
def policy_loss(cfg: DictConfig) -> None:
    """The keys a `policy_loss.loss_mode` cannot run without (verl's asserts, as one line before start)."""
    actor = cfg.actor_rollout_ref.actor
    pl = actor.policy_loss
    if pl.loss_mode == "dro" and pl.dro_beta is None:
        raise ConfigError(f"{_A}.actor.policy_loss.dro_beta", "must be set (> 0) for policy_loss.loss_mode=dro")
    if pl.loss_mode == "bypass_mode" and not cfg.async_training.use_rollout_log_probs:
        raise ConfigError(f"{_A}.actor.policy_loss.loss_mode",
                          "bypass_mode takes the rollout's log-probs as the old policy, but "
                          "algorithm.rollout_correction.bypass_mode=false (async_training.use_rollout_log_probs=false) "
                          "recomputes them; set bypass_mode=true or another loss_mode")


@check
def kl_control(cfg: DictConfig) -> None:
    """kl_ctrl steers the in-reward KL coefficient only (verl); the KL loss has its own fixed
    actor.kl_loss_coef. An adaptive controller with no in-reward KL would do nothing."""
    algo = cfg.algorithm
    if algo.kl_ctrl.type == "adaptive" and not algo.use_kl_in_reward:
        raise ConfigError(
            "algorithm.kl_ctrl.type",
            "adaptive steers the in-reward KL coefficient, but algorithm.use_kl_in_reward=false; set "
            "algorithm.use_kl_in_reward=true or kl_ctrl.type=fixed (the KL loss uses actor.kl_loss_coef, fixed)",
        )


@check
def filter_groups(cfg: DictConfig) -> None:
    """DAPO dynamic sampling runs at the Rollouter on scored groups (rollout/group_filter.py): it needs a
    metric, groups of two or more, a Rollouter, and a reward the Rollouter can know."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return
    key = "algorithm.filter_groups"
    if not fg.metric:
        raise ConfigError(f"{key}.metric", "required with filter_groups.enable=true (verl's: acc, score, seq_reward, "
                                           "seq_final_reward, or any key the reward function returns)")
    if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise ConfigError(f"{key}.metric", "seq_final_reward subtracts the in-reward KL (algorithm.use_kl_in_reward="
                                           "true), which the Rollouter cannot compute (no reference model there); "
                                           "filter on seq_reward (the reward before the KL)")
    if cfg.actor_rollout_ref.rollout.n < 2:
        raise ConfigError(f"{key}.enable", "a group of one response (actor_rollout_ref.rollout.n=1) has no spread "
                                           "to filter on; every group would be kept")
    if cfg.debug.train_only or cfg.debug.load_rollout_data:
        raise ConfigError(f"{key}.enable", "groups are filtered at the Rollouter, which debug.train_only / "
                                           "debug.load_rollout_data do not run")


@check
def old_log_probs_source(cfg: DictConfig) -> None:
    """Rollout correction weighs exp(old - rollout): in bypass mode old IS rollout, every
    weight is 1 and nothing is ever rejected or vetoed, so enabling it there is refused."""
    at, actor = cfg.async_training, cfg.actor_rollout_ref.actor
    if actor.use_rollout_log_probs != at.use_rollout_log_probs:
        raise ConfigError(
            "actor_rollout_ref.actor.use_rollout_log_probs",
            f"{actor.use_rollout_log_probs} conflicts with async_training.use_rollout_log_probs="
            f"{at.use_rollout_log_probs}; set async_training.use_rollout_log_probs (the actor key follows it)",
        )
    if actor.rollout_correction.enable and not derived.recomputes_old_log_probs(cfg):
        raise ConfigError(
            "actor_rollout_ref.actor.rollout_correction.enable",
            "true needs recomputed old log-probs, but async_training.use_rollout_log_probs=true (bypass) trains "
            "with the rollout's own log-probs as the old policy: every weight would be 1 and nothing rejected or "
            "vetoed; set async_training.use_rollout_log_probs=false (or async_training.compute_prox_log_prob=true)",
        )


# --------------------------------------------------------------------------- batches
def _dp_formula(cfg: DictConfig) -> str:
    world, mp = derived.trainer_world_size(cfg), derived.model_parallel_size(cfg)
    text = f"trainer.nnodes * trainer.n_gpus_per_node = {world}"
    return text if mp == 1 else f"{text}, divided by the model-parallel size {mp}"


def _micro_per_gpu(cfg: DictConfig, node: DictConfig, key: str, global_name: str, per_gpu_name: str) -> None:
    """verl's deprecated global micro-batch -> per-GPU (global // data-parallel size)."""
    global_mb = node[global_name]
    if global_mb is None:
        return
    dp = derived.trainer_dp_size(cfg)
    if global_mb % dp:
        raise ConfigError(f"{key}.{global_name}", f"{global_mb} is not divisible by the data-parallel size {dp}")
    node[per_gpu_name] = global_mb // dp


@check
def parallel_sizes(cfg: DictConfig) -> None:
    world = derived.trainer_world_size(cfg)
    mp = derived.model_parallel_size(cfg)
    if world % mp:
        if cfg.actor_rollout_ref.actor.strategy == "megatron":
            key, what = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size", "tensor * pipeline * context parallel size"
        else:
            key, what = "actor_rollout_ref.actor.ulysses_sequence_parallel_size", "ulysses sequence parallel size"
        raise ConfigError(key, f"{what} {mp} does not divide the trainer's {world} devices (trainer.nnodes * trainer.n_gpus_per_node)")
    per_node = cfg.rollout.n_gpus_per_node
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if per_node % tp:  # an engine replica's devices are on one node (verl_async/placement.py)
        raise ConfigError(
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            f"{tp} does not divide the rollout's {per_node} devices per node (rollout.n_gpus_per_node): an engine "
            "replica's devices must be on one node",
        )


@check
def mini_batch_divides(cfg: DictConfig) -> None:
    """Also turns verl's global micro-batch sizes into the per-GPU ones."""
    actor, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    dp = derived.trainer_dp_size(cfg)
    responses = actor.ppo_mini_batch_size * n
    if responses % dp:
        raise ConfigError(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"ppo_mini_batch_size * rollout.n = {actor.ppo_mini_batch_size} * {n} = {responses} responses is not "
            f"divisible by the trainer's data-parallel size {dp} ({_dp_formula(cfg)})",
        )
    aref = "actor_rollout_ref"
    _micro_per_gpu(cfg, actor, f"{aref}.actor", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu")
    _micro_per_gpu(cfg, cfg[aref].ref, f"{aref}.ref", "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu")
    _micro_per_gpu(cfg, cfg[aref].rollout, f"{aref}.rollout", "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu")
    if not actor.use_dynamic_bsz:
        micro = actor.ppo_micro_batch_size_per_gpu
        if micro is None:
            raise ConfigError(f"{aref}.actor.ppo_micro_batch_size_per_gpu", "must be set when use_dynamic_bsz=false")
        per_rank = responses // dp
        if per_rank % micro:
            raise ConfigError(
                f"{aref}.actor.ppo_micro_batch_size_per_gpu",
                f"{micro} does not divide the {per_rank} responses each of the {dp} data-parallel ranks gets per "
                f"mini-batch (ppo_mini_batch_size * rollout.n / data-parallel size)",
            )
    users = [("ref", derived.uses_reference_policy(cfg)), ("rollout", derived.recomputes_old_log_probs(cfg))]
    for role, used in users:
        node = cfg[aref][role]
        if used and not node.log_prob_use_dynamic_bsz and node.log_prob_micro_batch_size_per_gpu is None:
            raise ConfigError(f"{aref}.{role}.log_prob_micro_batch_size_per_gpu", "must be set when log_prob_use_dynamic_bsz=false")


@check
def group_size(cfg: DictConfig) -> None:
    est, n = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n
    if est in ("grpo", "rloo") and n < 2:
        raise ConfigError("actor_rollout_ref.rollout.n", f"algorithm.adv_estimator={est} compares responses within a group; needs n >= 2, got {n}")


@check
def queue_capacity(cfg: DictConfig) -> None:
    cap, need = cfg.async_training.queue_capacity, derived.required_samples(cfg)
    if cap is not None and cap < need:
        raise ConfigError(
            "async_training.queue_capacity",
            f"{cap} groups cannot hold one trainer step of {need} (ppo_mini_batch_size * require_batches)",
        )


@check
def lengths(cfg: DictConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.max_model_len is not None and rollout.max_model_len < rollout.prompt_length + rollout.response_length:
        raise ConfigError(
            "actor_rollout_ref.rollout.max_model_len",
            f"{rollout.max_model_len} < prompt_length + response_length = {rollout.prompt_length + rollout.response_length}",
        )


def token_budget_problem(cfg: DictConfig, null_tokens: Optional[int] = None) -> Optional[ConfigError]:
    """With dynamic batch sizes a micro-batch packs whole sequences up to a token budget, so the longest
    possible sequence must fit one (the trainer would otherwise fail at the first update, hours in).

    `null_tokens`: what a null budget stands for (4096 on CPU, trainer/token_budget.py); None: not known
    here (on an accelerator it is sized after the model is built, never below the longest sequence).
    """
    if cfg.debug.rollout_only:
        return None
    aref, data = cfg.actor_rollout_ref, cfg.data
    response = aref.rollout.response_length
    response_key = "data.max_response_length" if response == data.max_response_length else f"{_A}.rollout.response_length"
    longest = data.max_prompt_length + response
    budgets = [
        (f"{_A}.actor.ppo_max_token_len_per_gpu", aref.actor.ppo_max_token_len_per_gpu, aref.actor.use_dynamic_bsz,
         "update"),
        (f"{_A}.rollout.log_prob_max_token_len_per_gpu", aref.rollout.log_prob_max_token_len_per_gpu,
         aref.rollout.log_prob_use_dynamic_bsz and derived.recomputes_old_log_probs(cfg), "old log-prob"),
        (f"{_A}.ref.log_prob_max_token_len_per_gpu", aref.ref.log_prob_max_token_len_per_gpu,
         aref.ref.log_prob_use_dynamic_bsz and derived.uses_reference_policy(cfg), "reference log-prob"),
    ]
    # Ulysses: a micro-batch is split over sp ranks, so it holds sp x the per-device budget (verl's rule)
    sp = 1 if aref.actor.strategy == "megatron" else aref.actor.ulysses_sequence_parallel_size
    for key, value, used, what in budgets:
        budget = null_tokens if value is None else value
        if used and budget is not None and budget * sp < longest:
            said = f"{budget} tokens" if value is not None else f"null ({budget} tokens on CPU)"
            said += f" x ulysses_sequence_parallel_size {sp}" if sp > 1 else ""
            return ConfigError(
                key,
                f"{said} per {what} micro-batch cannot hold one sequence of up to data.max_prompt_length + "
                f"{response_key} = {data.max_prompt_length} + {response} = {longest} tokens (dynamic batch size packs "
                f"whole sequences); raise it to at least {-(-longest // sp)} or shorten those lengths",
            )
    return None


@check
def sequence_fits_token_budgets(cfg: DictConfig) -> None:
    """Budgets given as numbers; a null one is checked by the preflight (its value depends on the device)."""
    problem = token_budget_problem(cfg)
    if problem is not None:
        raise problem


@check
def long_tail(cfg: DictConfig) -> None:
    lt = cfg.async_training.long_tail
    replicas = derived.rollout_replicas(cfg)
    if lt.enable and not lt.heavy_replicas < replicas:
        raise ConfigError(
            "async_training.long_tail.heavy_replicas",
            f"P-DSR needs a fast and a heavy replica: heavy_replicas must be < the {replicas} rollout replica(s) "
            "(rollout.nnodes * rollout.n_gpus_per_node / rollout tensor_model_parallel_size), got "
            f"{lt.heavy_replicas}; add rollout devices or set async_training.long_tail.enable=false",
        )


# --------------------------------------------------------------------------- devices
@check
def sync_transport(cfg: DictConfig) -> None:
    transport, device = cfg.async_training.sync_transport, cfg.trainer.device
    needs = {"nccl": "cuda", "hccl": "npu", "cuda_ipc": "cuda"}.get(transport)
    if needs is not None and device != needs:
        raise ConfigError(
            "async_training.sync_transport",
            f"{transport} needs trainer.device={needs}, got {device}; use object_store (works on every device)",
        )
    problem = derived.cuda_ipc_problem(cfg) if transport == "cuda_ipc" else None
    if problem is not None:
        raise ConfigError("async_training.sync_transport", problem)


@check
def colocation(cfg: DictConfig) -> None:
    """`rollout.colocate`: engines on the trainer's own devices of one node (NCCL/HCCL refuse two processes per device)."""
    if not cfg.rollout.colocate or cfg.trainer.device == "cpu":
        return
    if cfg.trainer.nnodes != 1 or cfg.rollout.nnodes != 1:
        raise ConfigError("rollout.colocate", "colocation is single-node: set trainer.nnodes=1 and rollout.nnodes=1")
    rollout_devices, trainer_devices = cfg.rollout.n_gpus_per_node, cfg.trainer.n_gpus_per_node
    if rollout_devices > trainer_devices:
        raise ConfigError(
            "rollout.colocate",
            f"the engines share the trainer's devices: rollout.n_gpus_per_node={rollout_devices} must be <= "
            f"trainer.n_gpus_per_node={trainer_devices}",
        )
    if cfg.async_training.sync_transport not in ("object_store", "cuda_ipc"):
        raise ConfigError(
            "async_training.sync_transport",
            f"{cfg.async_training.sync_transport} cannot join two processes of one device (rollout.colocate=true); "
            "use object_store (or cuda_ipc on CUDA)",
        )


@check
def distillation(cfg: DictConfig) -> None:
    """`distillation.*`: the teachers and verl's rules (config/distillation.py)."""
    from verl_async.config.distillation import check_distillation

    check_distillation(cfg)


@check
def reward_model(cfg: DictConfig) -> None:
    """`reward.reward_model.*`: a reward model and where it runs (config/reward_model.py)."""
    from verl_async.config.reward_model import check_reward_model

    check_reward_model(cfg)


# --------------------------------------------------------------------------- observability
@check
def loggers(cfg: DictConfig) -> None:
    """verl's logger names; `tracking` (verl's deprecated name of wandb) is set to wandb here."""
    names = ["wandb" if name == "tracking" else name for name in cfg.trainer.logger]
    for name in names:
        problem = logger_problem(name)
        if problem:
            raise ConfigError("trainer.logger", problem)
    cfg.trainer.logger = list(dict.fromkeys(names))


# --------------------------------------------------------------------------- files
@check
def data_files(cfg: DictConfig) -> None:
    """Values may be a path, builtin://NAME (resolved by verl_async.data) or a list of them."""
    _check_files("data.train_files", cfg.data.train_files, required=True)
    _check_files("data.val_files", cfg.data.val_files, required=False)


@check
def custom_dataset_class(cfg: DictConfig) -> None:
    """data.custom_cls names a .py file and a class name (the preflight loads the class: verl_async.data.custom).
    Makes the path absolute: the Rollouter's working folder may differ."""
    custom = cfg.data.custom_cls
    if custom.path is None:
        return
    given = os.path.expanduser(custom.path)
    if not os.path.isfile(given):
        where = "" if os.path.isabs(given) else f" (relative to {os.getcwd()})"
        raise ConfigError("data.custom_cls.path", f"no such file: {custom.path}{where}")
    if not custom.name:
        raise ConfigError("data.custom_cls.name", f"not set; name the dataset class in {custom.path}")
    custom.path = os.path.abspath(given)


@check
def model_paths(cfg: DictConfig) -> None:
    """HF ids are accepted as is (no hub access here); local-looking paths must exist."""
    for key in ("actor_rollout_ref.model.path", "data.tokenizer"):
        path = OmegaConf.select(cfg, key)
        if path is None:
            continue
        if path.startswith(BUILTIN_PREFIX):
            if path[len(BUILTIN_PREFIX):] not in BUILTIN_MODELS:
                raise ConfigError(key, f"unknown built-in model {path!r}; known: " + ", ".join(BUILTIN_PREFIX + m for m in BUILTIN_MODELS))
        elif is_gguf(path):
            if not os.path.isfile(os.path.expanduser(path)):
                raise ConfigError(key, f"no such GGUF file: {path}")
        elif _has_scheme(path):
            raise ConfigError(key, f"{path!r}: remote paths are not supported; use a local folder or an HF id")
        elif _looks_local(path) or os.path.exists(os.path.expanduser(path)):
            _check_local_dir(key, path)


@check
def multi_turn(cfg: DictConfig) -> None:
    """Tool files load, tool names are unique, no P-DSR with multi-turn (verl_async/config/multi_turn.py)."""
    from verl_async.config.multi_turn import check_multi_turn

    check_multi_turn(cfg)


@check
def true_on_policy(cfg: DictConfig) -> None:
    """Engines, trainers and settings true on-policy mode cannot serve (verl_async/config/true_on_policy.py)."""
    from verl_async.config.true_on_policy import check_true_on_policy

    check_true_on_policy(cfg)


@check
def custom_reward_function(cfg: DictConfig) -> None:
    path = cfg.custom_reward_function.path
    if path and (path.endswith(".py") or _looks_local(path)) and not os.path.isfile(os.path.expanduser(path)):
        raise ConfigError("custom_reward_function.path", f"no such file: {path}")


@check
def resume(cfg: DictConfig) -> None:
    t = cfg.trainer
    if t.resume_mode == "resume_path":
        if not t.resume_from_path:
            raise ConfigError("trainer.resume_from_path", "must be set when trainer.resume_mode=resume_path")
        if not os.path.exists(os.path.expanduser(t.resume_from_path)):
            raise ConfigError("trainer.resume_from_path", f"no such checkpoint: {t.resume_from_path}")


@check
def checkpoint_contents(cfg: DictConfig) -> None:
    """A checkpoint always holds model, optimizer and extra (exactly-once resume needs all three); verl's
    `hf_model` adds actor/huggingface. Leaving one of the three out would be silently ignored: refused."""
    ckpt = cfg.actor_rollout_ref.actor.checkpoint
    for name in ("save_contents", "load_contents"):
        missing = [c for c in ("model", "optimizer", "extra") if c not in ckpt[name]]
        if missing:
            raise ConfigError(
                f"actor_rollout_ref.actor.checkpoint.{name}",
                f"must hold model, optimizer and extra (missing {', '.join(missing)}): checkpoints always save and "
                f"load all three for exactly-once resume; add hf_model for an HF folder beside each",
            )


# --------------------------------------------------------------------------- debug
@check
def debug_modes(cfg: DictConfig) -> None:
    """load_rollout_data implies train_only (slime semantics); this sets it."""
    d = cfg.debug
    if d.load_rollout_data:
        if d.rollout_only:
            raise ConfigError("debug.load_rollout_data", "implies train-only and cannot be combined with debug.rollout_only=true")
        if d.save_rollout_data:
            raise ConfigError("debug.load_rollout_data", "cannot be combined with debug.save_rollout_data")
        parent = os.path.dirname(os.path.expanduser(d.load_rollout_data)) or "."
        if not os.path.isdir(parent):
            raise ConfigError("debug.load_rollout_data", f"no such folder: {parent}")
        d.train_only = True
    if d.rollout_only and d.train_only:
        raise ConfigError("debug.train_only", "cannot be combined with debug.rollout_only=true")
    placeholders = {
        "debug.save_rollout_data": ("{rollout_id}",),
        "debug.load_rollout_data": ("{rollout_id}",),
        "debug.save_train_output": ("{rollout_id}", "{rank}"),
    }
    for key, needed in placeholders.items():
        pattern = OmegaConf.select(cfg, key)
        missing = [p for p in needed if pattern and p not in pattern]
        if missing:
            raise ConfigError(key, f"the path pattern must contain {' and '.join(needed)} (missing {', '.join(missing)})")


@check
def fail_replicas(cfg: DictConfig) -> None:
    """debug.fail_replicas and debug.fail_trainer (fault drills, config/fault_specs.py) parse and name what exists."""
    value = cfg.debug.fail_replicas
    if isinstance(value, ListConfig):
        value = list(value)
    try:
        parse_fail_replicas(value, derived.rollout_replicas(cfg))
        world = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
        trainer_value = cfg.debug.get("fail_trainer")
        parse_fail_trainer(list(trainer_value) if isinstance(trainer_value, ListConfig) else trainer_value, world)
    except FaultSpecError as exc:
        raise ConfigError(exc.key, exc.reason) from None
