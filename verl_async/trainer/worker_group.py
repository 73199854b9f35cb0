"""Trainer worker groups: one Ray actor per device, driven as one trainer (slime-like interface).

`RayWorkerGroup` is the driver side every backend shares (placement, timeouts, the
data plan, weight-bucket streaming, checkpoint folders); a backend names its rank
class (`FSDPWorkerGroup` -> `FSDPWorker`, `MegatronWorkerGroup` -> `MegatronWorker`)
and, when model parallelism makes the data-parallel size smaller than the world,
its ranks report their `dp_rank` from `init()`: all ranks of one model replica then
get the same part of the plan.

    group = FSDPWorkerGroup(cfg)                   # full Hydra config (DictConfig or dict)
    group.init()                                   # placement group, ranks, process group, FSDP2 models
    old = group.compute_log_prob(batch)            # [B, T] (and entropy with calculate_entropy=True)
    ref = group.compute_ref_log_prob(batch)        # [B, T], reference model
    metrics = group.update(batch)                  # one training step (all mini-batches / epochs)
    group.weight_sync_refs(transport, step, ...)  # weight sync, see below
    group.save(path, extra={...}); extra = group.load(path); group.export_hf(path)
    group.save_checkpoint(root, extra)             # root/global_step_N/actor + latest marker + rotation

Batches are TensorDicts from `verl_async.protocol.collate_groups` (one row per response)
plus the keys the call needs (all [B, T] float unless noted):

* compute_log_prob / compute_ref_log_prob: `prompts` [B,P] (left-padded), `responses` [B,T]
  (right-padded), `attention_mask` [B,P+T], `response_mask` [B,T].
* update: the above plus `old_log_probs`, `advantages`, `group_index` [B] (long, the GRPO
  group of each row); `ref_log_prob` when `actor.use_kl_loss`; and `loss_mask` (plus
  `is_weights` when `actor.rollout_correction.enable`) as the Trainer's
  `verl_async/trainer/prepare.py` computes them. A batch without `loss_mask` gets them here
  from the same function (`prepare.correction_inputs`): then `rollout_log_probs` is needed
  when the correction is enabled, and its `mismatch/*` metrics are reported whenever present
  (the Trainer leaves it out in bypass mode, where old_log_probs are the rollout's).

`update` metrics: actor/{pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl, loss, grad_norm, lr,
kl_loss (use_kl_loss), entropy (entropy_coeff != 0; else take it from
compute_log_prob(calculate_entropy=True)), skipped_steps, total_skipped_steps,
optimizer_steps, global_step, first_minibatch_ratio_dev_max (FSDP2: max |PPO ratio - 1| over the first
mini-batch's tokens, 0.0 when the training forward reproduces the old log-probs)}, mismatch/* (rollout correction metrics, when this call
computed the correction and `rollout_log_probs` is in the batch), perf/{train_tokens (real tokens x epochs),
forward_tokens (padding included), train_time_s, max_memory_allocated_gb}. Loss-type values are exact mini-batch values (averaged over
the step's mini-batches), not micro-batch averages.

The driver (this object) does all the planning: the DP split balanced by tokens, the
micro-batches, the mini-batches of whole groups and their loss normalisers (the step's
algorithm before it, rollout-correction weights included, is `trainer/prepare.py`). Workers
get the batch once through the object store plus their part of the plan.

Weight sync: each rank has one method, `weight_sync(transport, step, ...)`, that runs a step
of its half of the transport; `weight_sync_refs` starts one on the ranks and returns the refs,
so the driver in verl_async/sync/ waits on the trainer and the engines together. The full
weights of the current policy, as (HF name, CPU tensor): `verl_async.sync.object_store.
full_weights(group)`.

Failures: every wait has a timeout (`trainer.worker_timeout_s`); a dead actor raises
`WorkerGroupError` naming the rank and the call. After any worker failure the
collectives are out of step: the group refuses further calls; `shutdown()` and build
a new one (e.g. from the last checkpoint).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import torch

from verl_async.trainer.batching import (
    LAYOUT_KEYS,
    UPDATE_KEYS,
    check_batch,
    check_lengths,
    plan_forward,
    plan_update,
    sequence_lengths,
)
from verl_async.checkpoint import (
    checkpoint_dir,
    mark_latest,
    publish,
    rotate_checkpoints,
    staging_dir,
    write_run_info,
)
from verl_async.placement import NodePlan, PlacementError, Reservation, reserve
from verl_async.trainer.fsdp_worker import FSDPWorker
from verl_async.trainer.loss import loss_data_keys
from verl_async.trainer.prepare import correction_inputs
from verl_async.trainer.settings import TrainerSettings
from verl_async.trainer.token_budget import device_budget, unset_budgets
from verl_async.utils import device as device_layer
from verl_async.utils.shared_dirs import SharedDir, SharedDirError
from verl_async.utils.startup import Phase, StartupClock
from verl_async.utils.waiting import WaitTimeout, finished_in_turn

if TYPE_CHECKING:  # tensordict (and torch._dynamo under it) loads with the first batch, not at start-up
    from tensordict import TensorDict

# Host CPUs reserved per rank: tiny on CPU (tests and demo share a small machine).
_CPU_PER_RANK = {"cpu": 0.2, "cuda": 1.0, "npu": 1.0}


def trainer_node_plan(device: str, nnodes: int, n_gpus_per_node: int, node_resource: Optional[str] = None) -> NodePlan:
    """trainer.nnodes nodes of trainer.n_gpus_per_node ranks, each rank with its host CPUs and one device."""
    member = {"CPU": _CPU_PER_RANK[device]}
    if device != "cpu":
        member[device_layer.ray_resource_name(device)] = 1.0
    return NodePlan("trainer", nnodes, n_gpus_per_node, member, node_resource)


class WorkerGroupError(RuntimeError):
    """A worker died, timed out or failed; the group can not continue."""


def _plain_config(config: Any, owner: str) -> dict:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        pass
    if not isinstance(config, Mapping):
        raise TypeError(f"{owner}: config must be a DictConfig or a mapping, got {type(config).__name__}")
    return dict(config)


class RayWorkerGroup:
    """Driver of one rank class (`worker_cls`); see the module docstring."""

    worker_cls: Any = None
    default_name = "actor"

    def __init__(self, config: Any, *, name: Optional[str] = None, shared_dirs: Sequence[SharedDir] = ()):
        self.config = _plain_config(config, type(self).__name__)
        self.shared_dirs = tuple(shared_dirs)  # checked on every node that gets ranks (utils/shared_dirs.py)
        self.settings = TrainerSettings.from_config(self.config)
        self.name = name or self.default_name
        self.world_size = self.settings.world_size
        self.dp_size = self.world_size  # model-parallel backends shrink it (see _set_dp_ranks)
        self.dp_ranks = list(range(self.world_size))
        self.workers: list[Any] = []
        self.global_step = 0
        self._placement: Optional[Reservation] = None
        self._broken: Optional[str] = None
        self.info: list[dict] = []
        self.startup_phases: list[Phase] = []  # init's steps, absolute times (utils/startup.py)
        self.rank_reports: list[tuple[float, dict]] = []  # (asked for at, the rank's start-up report)

    # ------------------------------------------------------------------ lifecycle
    def init(self) -> list[dict]:
        import ray

        s = self.settings
        kind = s.device
        cpus = _CPU_PER_RANK[kind]
        # one bundle per node (verl_async/placement.py): rank r runs on node r // n_gpus_per_node
        clock = StartupClock()
        try:
            with clock.phase("reserve"):
                plan = trainer_node_plan(kind, s.nnodes, s.n_gpus_per_node, s.node_resource)
                self._placement = reserve(plan, s.worker_timeout_s)
        except PlacementError as exc:
            raise WorkerGroupError(f"{self.name}: {exc}") from None
        actor_cls = ray.remote(self.worker_cls)
        asked = time.time()
        for rank in range(self.world_size):
            options: dict[str, Any] = dict(
                num_cpus=cpus,
                scheduling_strategy=self._placement.strategy(rank),
            )
            if kind == "cuda":
                options["num_gpus"] = 1
            elif kind == "npu":
                options["resources"] = {"NPU": 1}
            self.workers.append(actor_cls.options(**options).remote(self.config, rank, self.world_size))
        with clock.phase("ranks_start"):  # their processes and imports: the first call waits for them
            missing = [p for p in self._call("node_problem", self.shared_dirs) if p]  # before any rank reads or writes
        if missing:
            raise SharedDirError(missing[0])
        with clock.phase("ranks_init"):  # process group, model, optimizer (each rank's lane has the details)
            addr, port = self._call_one(0, "master_address")
            self.info = self._call("init", addr, port)
        self._set_dp_ranks(self.info)
        with clock.phase("token_budget"):
            self._size_token_budgets()
        self.rank_reports = [(asked, report) for report in self._call("startup_report")]
        self.startup_phases = clock.phases
        return self.info

    def placement(self) -> list[str]:
        """The node of each rank (empty before init)."""
        return [] if self._placement is None else self._placement.member_nodes()

    def _size_token_budgets(self) -> None:
        """Budgets the config left to the device (null): sized from the ranks' free memory (token_budget.py)."""
        import logging

        unset = unset_budgets(self.settings)
        if not unset:
            return
        data = self.config.get("data", {})
        longest = int(data.get("max_prompt_length", 0) or 0) + int(data.get("max_response_length", 0) or 0)
        tokens, why = device_budget([i["memory"] for i in self.info], longest,
                                    gradient_checkpointing=self.settings.gradient_checkpointing)
        logging.getLogger("verl_async.trainer").warning("%s: %s = %s", self.name, ", ".join(unset), why)
        self.set_options(**{key: tokens for key in unset})

    def _set_dp_ranks(self, info: list[dict]) -> None:
        """Ranks that report a `dp_rank` share the plan of their model replica."""
        if all("dp_rank" in i for i in info):
            self.dp_ranks = [int(i["dp_rank"]) for i in info]
            self.dp_size = max(self.dp_ranks) + 1

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        self.workers = []
        if self._placement is not None:
            self._placement.release()
            self._placement = None

    # ------------------------------------------------------------------ calls
    def wait(self, refs: list, what: str, timeout: Optional[float] = None) -> list:
        """Results of one ref per rank; a dead, failing or late rank raises naming it (and breaks the group)."""
        import ray

        if self._broken:
            raise WorkerGroupError(f"{self.name}: unusable after an earlier failure ({self._broken}); "
                                   f"shutdown() and build a new group")
        timeout = self.settings.worker_timeout_s if timeout is None else timeout
        results: dict[int, Any] = {}
        try:
            for rank, ref, left in finished_in_turn(dict(enumerate(refs)), timeout):
                try:
                    results[rank] = ray.get(ref, timeout=left)
                except ray.exceptions.RayActorError as exc:
                    self._broken = f"rank {rank} died during {what}"
                    raise WorkerGroupError(f"{self.name}: worker rank {rank} died during {what}: {exc}") from exc
                except ray.exceptions.RayTaskError:
                    self._broken = f"rank {rank} raised in {what}"
                    raise  # also an instance of the worker's exception class (ValueError, ...)
        except WaitTimeout as late:
            self._broken = f"{what} timed out on ranks {late.pending}"
            raise WorkerGroupError(f"{self.name}: {what} did not finish on ranks {late.pending} within {timeout:.0f}s "
                                   f"(trainer.worker_timeout_s)") from None
        return [results[i] for i in range(len(refs))]

    def _call(self, method: str, *args, **kwargs) -> list:
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return self.wait(refs, method)

    def _call_one(self, rank: int, method: str, *args, **kwargs):
        return self.wait([getattr(self.workers[rank], method).remote(*args, **kwargs)], method)[0]

    def _call_planned(self, method: str, batch_ref, plans: list, *args, **kwargs) -> list:
        refs = [getattr(w, method).remote(batch_ref, plans[self.dp_ranks[rank]], *args, **kwargs)
                for rank, w in enumerate(self.workers)]
        return self.wait(refs, method)

    def set_options(self, **overrides: Any) -> None:
        """Change runtime knobs (TrainerSettings.RUNTIME_KEYS) on the driver and every rank."""
        self.settings = self.settings.with_overrides(overrides)
        self._call("set_options", overrides)

    # ------------------------------------------------------------------ log-probs
    def compute_log_prob(self, batch: TensorDict, *, calculate_entropy: bool = False):
        """Actor log-probs [B, T] at `rollout.temperature` (0 on padding); with entropy: (log_probs, entropy)."""
        s = self.settings
        out = self._log_probs(batch, "compute_log_prob", use_ref=False, calculate_entropy=calculate_entropy,
                              dynamic=s.log_prob_use_dynamic_bsz, micro=s.log_prob_micro_batch_size_per_gpu,
                              max_tokens=s.log_prob_max_token_len_per_gpu,
                              key="actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu")
        return out if calculate_entropy else out[0]

    def compute_ref_log_prob(self, batch: TensorDict) -> torch.Tensor:
        """Reference-model log-probs [B, T] (needs actor.use_kl_loss or algorithm.use_kl_in_reward)."""
        s = self.settings
        if not s.need_ref:
            raise RuntimeError("compute_ref_log_prob: no reference model (actor_rollout_ref.actor.use_kl_loss and "
                               "algorithm.use_kl_in_reward are both false)")
        return self._log_probs(batch, "compute_ref_log_prob", use_ref=True, calculate_entropy=False,
                               dynamic=s.ref_log_prob_use_dynamic_bsz, micro=s.ref_log_prob_micro_batch_size_per_gpu,
                               max_tokens=s.ref_log_prob_max_token_len_per_gpu,
                               key="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu")[0]

    def _log_probs(self, batch: TensorDict, call: str, *, use_ref: bool, calculate_entropy: bool, dynamic: bool,
                   micro: int, max_tokens: int, key: str):
        import ray

        n = check_batch(batch, LAYOUT_KEYS, call)
        p_len, r_len = sequence_lengths(batch)
        max_tokens = self.settings.group_tokens(max_tokens)  # a sequence-parallel group holds sp x the budget
        weights = check_lengths(p_len, r_len, max_tokens if dynamic else None, key)
        plan = plan_forward(weights, self.dp_size, dynamic=dynamic, micro_size=micro, max_tokens=max_tokens)
        ref = ray.put(batch.select(*LAYOUT_KEYS))
        outs = self._call_planned("compute_log_prob", ref, plan, use_ref=use_ref,
                                  calculate_entropy=calculate_entropy)
        width = batch["responses"].shape[1]
        logp = torch.zeros(n, width)
        ent = torch.zeros(n, width) if calculate_entropy else None
        for out in outs:
            if out["rows"]:
                idx = torch.as_tensor(out["rows"], dtype=torch.long)
                logp[idx] = out["log_probs"]
                if ent is not None:
                    ent[idx] = out["entropy"]
        return logp, ent

    # ------------------------------------------------------------------ update
    def update(self, batch: TensorDict, *, profile: Optional[dict] = None) -> dict[str, Any]:
        """One training step on the batch; returns metrics (actor/*, mismatch/*, perf/*).

        `profile={"dir": ..., "tag": ...}` (FSDP ranks): the step runs under torch.profiler on
        every rank; `perf/profile` is then the list of the ranks' summaries (see
        verl_async.utils.profile_summary) and each rank writes `dir/<tag>_rank<r>.json.gz`.
        """
        import ray

        s = self.settings
        rc = s.rollout_correction
        metrics: dict[str, Any] = {}
        if "loss_mask" in batch.keys():  # prepared on the driver (verl_async/trainer/prepare.py)
            self._check_update_batch(batch, ["loss_mask"] + (["is_weights"] if rc.enable else []))
            correction = {k: batch[k] for k in ("loss_mask", "is_weights") if k in batch.keys()}
        else:  # not prepared (tests, scripts): the loss mask and weights prepare_batch adds, by the same function
            self._check_update_batch(batch, ["rollout_log_probs"] if rc.enable else [])
            rollout = batch["rollout_log_probs"] if "rollout_log_probs" in batch.keys() else None
            correction, metrics = correction_inputs(batch["old_log_probs"], rollout, batch["response_mask"], rc)
        p_len, r_len = sequence_lengths(batch)
        max_tokens = s.group_tokens(s.ppo_max_token_len_per_gpu)  # x ulysses_sequence_parallel_size, as in verl
        weights = check_lengths(p_len, r_len, max_tokens if s.use_dynamic_bsz else None,
                                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
        send = {k: batch[k] for k in LAYOUT_KEYS + ("old_log_probs", "advantages")}
        send.update(correction)
        if s.use_kl_loss:
            send["ref_log_prob"] = batch["ref_log_prob"]
        teacher_keys = loss_data_keys(s.distillation)
        if teacher_keys:  # distillation: the teachers' scores of every response (rollout side, verl_async/teachers/)
            self._check_update_batch(batch, list(teacher_keys))
            send.update({k: batch[k] for k in teacher_keys})
        plans = plan_update(batch["group_index"], weights, send["loss_mask"], mini_groups=s.ppo_mini_batch_size,
                            epochs=s.ppo_epochs, shuffle=s.shuffle, seed=s.seed * 100003 + self.global_step,
                            dp=self.dp_size, dynamic=s.use_dynamic_bsz, micro_size=s.ppo_micro_batch_size_per_gpu,
                            max_tokens=max_tokens)
        loss_keys = [k for k in ("loss_mask", "old_log_probs", "advantages", "is_weights", "ref_log_prob") + teacher_keys
                     if k in send]
        from tensordict import TensorDict

        ref = ray.put(TensorDict(send, batch_size=batch.batch_size))
        extra = {"profile": profile} if profile else {}
        refs = [w.update.remote(ref, plans, loss_keys, **extra) for w in self.workers]
        outs = self.wait(refs, "update")
        metrics.update(outs[0])
        if profile:
            metrics["perf/profile"] = [o.get("perf/profile") for o in outs]
        reasons = list(dict.fromkeys(r for o in outs for r in o.get("actor/skip_reasons", [])))
        if reasons:  # with pipeline parallelism only the last stage sees the loss
            metrics["actor/skip_reasons"] = reasons[:4]
        metrics["perf/forward_tokens"] = float(sum(o["perf/forward_tokens_rank"] for o in outs))
        metrics["perf/train_tokens"] = float(batch["attention_mask"].sum()) * s.ppo_epochs
        metrics.pop("perf/forward_tokens_rank", None)
        metrics["perf/max_memory_allocated_gb"] = max(o["perf/max_memory_allocated_gb"] for o in outs)
        self.global_step = int(outs[0]["actor/global_step"])
        return metrics

    def _check_update_batch(self, batch: TensorDict, extra_keys: list[str]) -> None:
        """update() needs these keys, finite at valid response tokens (a NaN would poison the step)."""
        keys = list(UPDATE_KEYS) + (["ref_log_prob"] if self.settings.use_kl_loss else []) + list(extra_keys)
        check_batch(batch, keys, "update")
        valid = batch["response_mask"].bool()
        for key in ("old_log_probs", "advantages", "ref_log_prob", "rollout_log_probs", "is_weights"):
            if key in keys:
                bad = valid & ~torch.isfinite(batch[key])
                if bool(bad.any()):
                    row = int(bad.any(dim=1).nonzero()[0])
                    raise ValueError(f"update: batch[{key!r}] holds NaN/inf at valid response tokens "
                                     f"(first in row {row})")

    # ------------------------------------------------------------------ weight sync
    def weight_sync_refs(self, transport: str, step: str, *args: Any, ranks: Optional[list[int]] = None,
                         streaming: bool = False, **kwargs: Any) -> list:
        """Start `step` of `transport`'s trainer half on `ranks` (default: all) and return the refs: the sync
        driver (verl_async/sync/) waits for them together with the engines'. `streaming`: generator steps."""
        if self._broken:
            raise WorkerGroupError(f"{self.name}: unusable after an earlier failure ({self._broken})")
        workers = self.workers if ranks is None else [self.workers[r] for r in ranks]
        if streaming:
            return [w.weight_sync_stream.options(num_returns="streaming", _generator_backpressure_num_objects=2)
                    .remote(transport, step, *args, **kwargs) for w in workers]
        return [w.weight_sync.remote(transport, step, *args, **kwargs) for w in workers]

    def mark_broken(self, reason: str) -> None:
        """A caller saw the ranks fall out of step (e.g. a sync timed out): refuse further calls."""
        self._broken = reason

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, extra: Optional[dict] = None) -> str:
        """Checkpoint to `path` (a folder on storage every rank sees); `extra` comes back from load()."""
        self._call("save", path, extra)
        return path

    def save_checkpoint(self, root: str, extra: Optional[dict] = None, step: Optional[int] = None,
                        info: Optional[dict] = None) -> str:
        """verl layout: `root/global_step_{N}/actor`, then the latest marker and `max_actor_ckpt_to_keep` rotation.

        Written to a staging folder and renamed into place when complete: never a torn checkpoint.
        `info` (JSON) goes beside it as run_info.json: what a later resume is checked against.
        """
        step = self.global_step if step is None else int(step)
        staging = staging_dir(root, step)
        self.save(staging, extra)
        if info is not None:
            write_run_info(staging, info)
        publish(root, step)
        mark_latest(root, step)
        rotate_checkpoints(root, self.settings.max_ckpt_to_keep)
        return checkpoint_dir(root, step)

    def load(self, path: str) -> dict:
        extra = self._call("load", path)[0]
        self.global_step = int(self._call_one(0, "state")["global_step"])
        return extra

    def export_hf(self, path: str, dtype: Optional[str] = None) -> str:
        """`save_pretrained` folder (config, safetensors, tokenizer) of the current policy."""
        self._call("export_hf", path, dtype)
        return path

    def state(self) -> dict:
        return self._call_one(0, "state")


class FSDPWorkerGroup(RayWorkerGroup):
    """FSDP2 ranks (`FSDPWorker`): every rank is a data-parallel rank, or with Ulysses sequence parallelism every
    group of `ulysses_sequence_parallel_size` consecutive ranks is one (trainer/ulysses.py)."""

    worker_cls = FSDPWorker
    default_name = "fsdp_actor"
