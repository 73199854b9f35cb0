"""Quantities derived from a validated config (one definition each, shared by all modules)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from verl_async import staleness


CPU_TOKEN_BUDGET = 4096  # what a null micro-batch token budget means on CPU (trainer/token_budget.py on GPUs)


def rollout_max_model_len(rollout_cfg: Mapping[str, Any]) -> Optional[int]:
    """Longest prompt + response: `rollout.max_model_len`, else prompt_length + response_length, else None.

    The native engine's slot length, and in true on-policy mode the attention span both sides share."""
    get = rollout_cfg.get
    if get("max_model_len"):
        return int(get("max_model_len"))
    if get("prompt_length") and get("response_length"):
        return int(get("prompt_length")) + int(get("response_length"))
    return None


def trainer_world_size(cfg: Any) -> int:
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def model_parallel_size(cfg: Any) -> int:
    """Ranks that hold one model replica: ulysses SP (FSDP) or TP * PP * CP (Megatron)."""
    actor = cfg.actor_rollout_ref.actor
    if actor.strategy == "megatron":
        mc = actor.megatron
        return mc.tensor_model_parallel_size * mc.pipeline_model_parallel_size * mc.context_parallel_size
    return actor.ulysses_sequence_parallel_size


def trainer_dp_size(cfg: Any) -> int:
    """Data-parallel size of the trainer: a mini-batch is split into this many equal parts."""
    return trainer_world_size(cfg) // model_parallel_size(cfg)


def required_samples(cfg: Any) -> int:
    """Prompt groups the Trainer takes per step: ppo_mini_batch_size * require_batches."""
    return cfg.actor_rollout_ref.actor.ppo_mini_batch_size * cfg.async_training.require_batches


def max_required_samples(cfg: Any) -> int:
    """Most groups the Rollouter may produce per parameter version (verl's formula)."""
    at = cfg.async_training
    return staleness.max_required_samples(required_samples(cfg), at.trigger_parameter_sync_step, at.staleness_threshold)


def rollout_replicas(cfg: Any) -> int:
    """Inference engine replicas: rollout devices / rollout tensor-parallel size."""
    devices = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    return devices // cfg.actor_rollout_ref.rollout.tensor_model_parallel_size


def cpu_threads(cfg: Any, cores: Optional[int] = None) -> Optional[int]:
    """Torch threads of each trainer rank and engine replica on a CPU run (None on an accelerator): the cores
    (`ray_init.num_cpus`, else this machine's) shared equally by the ranks and the replicas, which compute at
    the same time (utils/threads.py). `trainer.cpu_threads_per_worker` set fixes the ranks' count instead."""
    if cfg.trainer.device != "cpu":
        return None
    from verl_async.utils.threads import cpu_share_threads, local_cores

    cores = cores or cfg.get("ray_init", {}).get("num_cpus") or local_cores()
    ranks = 0 if cfg.debug.get("rollout_only") else trainer_world_size(cfg)
    replicas = 0 if cfg.debug.get("train_only") or cfg.debug.get("load_rollout_data") else rollout_replicas(cfg)
    return cpu_share_threads(int(cores), max(1, ranks + replicas))


def colocated_device_ids(cfg: Any) -> Optional[list[str]]:
    """`rollout.colocate=true` on an accelerator: the ids the replicas share with the trainer's ranks.

    One node: the trainer's ranks hold devices 0..world-1 of it; replica i pins ids[i*tp:(i+1)*tp].
    """
    if not cfg.rollout.get("colocate", False) or cfg.trainer.device == "cpu":
        return None
    return [str(i) for i in range(cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node)]


def uses_reference_policy(cfg: Any) -> bool:
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def recomputes_old_log_probs(cfg: Any) -> bool:
    """The trainer recomputes old log-probs unless it uses the rollout's (bypass mode)."""
    at = cfg.async_training
    return bool(not at.use_rollout_log_probs or at.compute_prox_log_prob)


def cuda_ipc_problem(cfg: Any) -> Optional[str]:
    """Why `sync_transport=cuda_ipc` cannot serve this layout, or None: colocated native-engine replicas (tensor
    parallel 1, one node), each mapping the buffers of the FSDP2 rank on its GPU (replica i pins the node's device
    i, `colocated_device_ids`; sync/cuda_ipc.py routes by GPU). The config check raises it; `auto` picks cuda_ipc
    when None."""
    rollout = cfg.actor_rollout_ref.rollout
    if not cfg.rollout.colocate:
        return ("cuda_ipc needs rollout.colocate=true (the engine maps the trainer's GPU memory, so it must run on "
                "the trainer's GPU); with separate GPUs use nccl or object_store")
    if rollout.name == "vllm":
        return ("cuda_ipc is not supported with actor_rollout_ref.rollout.name=vllm (only the native engine loads "
                "IPC-mapped buckets); use object_store")
    if cfg.actor_rollout_ref.actor.strategy == "megatron":
        return "cuda_ipc is not supported with actor_rollout_ref.actor.strategy=megatron; use object_store"
    tp = int(rollout.tensor_model_parallel_size or 1)
    if tp != 1:
        return ("cuda_ipc maps one trainer rank's GPU into each engine replica on that GPU: set "
                f"actor_rollout_ref.rollout.tensor_model_parallel_size=1, got {tp}; or use object_store")
    if cfg.trainer.nnodes != 1 or cfg.rollout.nnodes != 1:
        return (f"cuda_ipc is single-node: set trainer.nnodes=1 and rollout.nnodes=1, got {cfg.trainer.nnodes} and "
                f"{cfg.rollout.nnodes}; or use object_store")
    replicas, ranks = int(cfg.rollout.n_gpus_per_node), int(cfg.trainer.n_gpus_per_node)
    if replicas > ranks:
        return (f"cuda_ipc serves each engine replica from the trainer rank on its GPU: rollout.n_gpus_per_node="
                f"{replicas} replicas need as many trainer GPUs, trainer.n_gpus_per_node={ranks}; set them equal or "
                "use object_store")
    return None


def auto_sync_transport(cfg: Any) -> str:
    """`sync_transport=auto`: cuda_ipc where it applies (on CUDA, `cuda_ipc_problem` is None: no host copy; one
    replica of a 135M model took 0.12 s per sync on an H100 instead of 1.0-1.2 s, and 2 ranks + 2 replicas of the
    3B shape on 2 H200s moved 6.2 GB through the object store in 25.0 s per sync, bench/RESULTS.md issue 37);
    nccl when the rollout has GPUs of its own (`rollout.colocate=false` on CUDA: 0.09 s per sync of a 0.5B model
    on 2 H200s, where the object store took 3.5 s, and 12 s for 1.5B; bench/RESULTS.md "Two GPUs"); else
    object_store (every device and layout)."""
    if cfg.trainer.device == "cuda" and cuda_ipc_problem(cfg) is None:
        return "cuda_ipc"
    # The Megatron trainer's collective sender has run on CPU (gloo) only: it is chosen by name until a GPU run
    if cfg.trainer.device == "cuda" and not cfg.rollout.colocate and cfg.actor_rollout_ref.actor.strategy != "megatron":
        return "nccl"
    return "object_store"


SPLIT_TRIGGER = 4  # verl's default (fully_async_ppo_trainer.yaml); measured best on a split layout (bench/RESULTS.md)
OTHER_TRIGGER = 2


def auto_trigger_parameter_sync_step(cfg: Any) -> int:
    """`trigger_parameter_sync_step=null`: 4 when the rollout has accelerators of its own (`rollout.colocate=false`
    on cuda / npu), else 2. On 2 H200s with a long tail (0.5B shape, staleness 0.5) a sync every step left the engine
    with 53 requests on average (the staleness budget held admission 65 s of a 72 s window), every 4 steps with 142:
    1.35x the trained tokens/s (bench/RESULTS.md "Two GPUs")."""
    if cfg.trainer.device in ("cuda", "npu") and not cfg.rollout.colocate:
        return SPLIT_TRIGGER
    return OTHER_TRIGGER


# trainer.val_timeout_s=null: every validation token at 100 tokens/s (however many replicas share them), >= 10 min.
VAL_TIMEOUT_FLOOR_S = 600.0
VAL_TIMEOUT_S_PER_TOKEN = 0.01
VAL_TIMEOUT_RULE = "null: max(600 s, 0.01 s x validation prompts x val_kwargs.n x rollout.response_length)"
FINISH_TIMEOUT_RULE = ("null: 2 x trainer.worker_timeout_s for the final sync and checkpoint + the validation timeout "
                       "(twice with trainer.val_async: one may still run)")


def validation_timeout_s(cfg: Any, val_prompts: int) -> float:
    """How long one validation may take: `trainer.val_timeout_s`, or VAL_TIMEOUT_RULE when it is null."""
    configured = cfg.trainer.get("val_timeout_s")
    if configured is not None:
        return float(configured)
    rollout = cfg.actor_rollout_ref.rollout
    tokens = int(val_prompts) * int(rollout.val_kwargs.n) * int(rollout.response_length)
    return max(VAL_TIMEOUT_FLOOR_S, VAL_TIMEOUT_S_PER_TOKEN * tokens)


def finish_timeout_s(cfg: Any, validation_s: float) -> float:
    """How long the end of a run (final sync, checkpoint, validation) may take: `trainer.finish_timeout_s`, or
    FINISH_TIMEOUT_RULE when it is null (`validation_s` is 0 when no final validation runs)."""
    configured = cfg.trainer.get("finish_timeout_s")
    if configured is not None:
        return float(configured)
    return 2.0 * float(cfg.trainer.worker_timeout_s) + float(validation_s)


START_TIMEOUT_KEY = "rollout.start_timeout_s"


def replica_start_timeout_s(cfg: Any) -> float:
    """How long the engine replicas may take to load the model and start: `rollout.start_timeout_s`, or
    `trainer.worker_timeout_s` (the trainer's own start-up bound) when it is null."""
    configured = cfg.rollout.get("start_timeout_s")
    return float(configured) if configured is not None else float(cfg.trainer.worker_timeout_s)
