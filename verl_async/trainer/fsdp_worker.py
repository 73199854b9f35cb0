"""One FSDP2 training rank: the policy (and reference) model, optimizer, schedule, checkpoints.

A plain class: the worker group wraps it as a Ray actor (one per device), a test can
drive it in-process. All ranks receive the same calls with the same plan (computed
once by the driver, see `batching`), so every forward/backward and every collective
happens on every rank in the same order; a rank without rows runs a dummy
micro-batch instead of skipping.

Precision: the master weights, gradients after reduction and optimizer state are
float32; on GPU/NPU FSDP2's `MixedPrecisionPolicy` runs forward/backward in
`fsdp_config.mixed_precision.param_dtype` (bf16) and reduces in `reduce_dtype` (fp32).
CPU runs everything in float32 (exact tests).

True on-policy mode (`actor_rollout_ref.rollout.true_on_policy`, `settings.true_on_policy_span`):
both models are patched with verl_async.invariant's batch-invariant kernels before sharding and
the log-probs come from its fixed-chunk kernel, so every forward (no-grad log-probs, the training
forward with autograd) gives each response token the native engine's sampling log-prob, bit for bit.

Reference model: a second FSDP2 module from the same weights, frozen, with
`CPUOffloadPolicy` on accelerators (parameters live on the host and visit the device
only inside its forward). The actor's weights are never swapped in and out by hand:
slime found that drifts (KL != 0 on the first step).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from verl_async.algos import logprobs_and_entropy, logprobs_from_logits, ratio_deviation_max
from verl_async.invariant import environment_problem, make_invariant
from verl_async.invariant.attention import ATTENTION_NAME
from verl_async.invariant.logprob import token_logprobs, token_logprobs_and_entropy
from verl_async.trainer import offload
from verl_async.trainer.attention import resolve_attn_implementation
from verl_async.trainer.batching import MiniBatchPlan, ModelInputs, build_model_inputs, gather_rows
from verl_async.trainer.hf_export import HF_SUBDIR
from verl_async.trainer.common import DTYPES, RankBase, eval_mode, log_prob_model
from verl_async.trainer.faults import die_in_update
from verl_async.trainer.rank_results import METRIC_KEYS, LogProbRows, UpdateStats, nonfinite_grads
from verl_async.trainer.loss import LossConfig, guarded_actor_loss, student_topk
from verl_async.trainer.lr_schedule import build_lr_scheduler
from verl_async.trainer import lora as lora_mod
from verl_async.trainer.settings import TrainerSettings
from verl_async.trainer.ulysses import (ULYSSES, build_sp_group, gather_sequence, register_ulysses_attention,
                                        sequence_parallel, slice_packed)
from verl_async.utils import device as device_layer
from verl_async.utils.preimport import import_model_stack
from verl_async.utils.startup import StartupClock

if TYPE_CHECKING:  # tensordict (and torch._dynamo under it) loads with the first batch, not at start-up
    from tensordict import TensorDict

logger = logging.getLogger(__name__)



def _decoder_layer_classes(model: torch.nn.Module) -> set[str]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules: cannot find its decoder layers "
                         f"to shard with FSDP2")
    return names


class FSDPWorker(RankBase):
    """One rank. Call order: `master_address()` (rank 0) -> `init(addr, port)` on all ranks -> work."""

    def __init__(self, config: dict, rank: int, world_size: int):
        self._startup = StartupClock()
        self.config = config
        self.settings = TrainerSettings.from_config(config)
        self.rank, self.world_size = rank, world_size
        self.sp = None  # this rank's Ulysses group (trainer/ulysses.py), None without sequence parallelism
        self.dp_rank = rank // self.settings.sp  # the data-parallel share it trains on (its sp group's)
        self.global_step = 0
        self.skipped_steps = 0
        self.model: Any = None
        self.ref_model: Any = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.lr_scheduler: Any = None
        self.compute_dtype = self.settings.param_dtype
        self._profiling = False  # update(profile=...): `verl::*` ranges for the profile summary
        # transformers' model stack imports while this rank answers its first calls and joins the process group
        self._model_stack = import_model_stack(self.settings.model_path,
                                               extra=("torch.distributed.fsdp", "torch.distributed.device_mesh"))

    # ------------------------------------------------------------------ setup
    def init(self, master_addr: str, master_port: int) -> dict[str, Any]:
        s = self.settings
        with self.startup.phase("dist_init"):  # the device, the default process group
            self._init_distributed(master_addr, master_port)
        with self.startup.phase("model_imports"):  # what is left of the model stack's import (utils/preimport.py)
            self._model_stack.wait()
        from torch.distributed.device_mesh import init_device_mesh

        # FSDP2 shards over every rank; with Ulysses, groups of sp consecutive ranks split the sequence (as verl)
        self.mesh = init_device_mesh(s.device, (self.world_size,), mesh_dim_names=("dp",))
        self.sp = build_sp_group(self.world_size, self.rank, s.sp)
        torch.manual_seed(s.seed)
        if s.true_on_policy_span is not None:
            problem = environment_problem(s.device)
            if problem is not None:
                raise RuntimeError(problem)
        self.attn_implementation = resolve_attn_implementation(s.attn_implementation, s.device)
        if self.sp is not None:  # all-to-all around the resolved kernel
            self.attn_implementation = register_ulysses_attention(self.attn_implementation)
        self.model = self._build_model(train=True)
        self.pad_token_id = int(self.model.config.pad_token_id or 0)
        with self.startup.phase("optimizer"):
            self.optimizer = torch.optim.AdamW(  # LoRA: the adapters only (the base weights are frozen)
                [p for p in self.model.parameters() if p.requires_grad], lr=s.optim.lr, betas=s.optim.betas,
                eps=s.optim.eps, weight_decay=s.optim.weight_decay,
            )
            self.lr_scheduler = build_lr_scheduler(
                self.optimizer, kind=s.optim.lr_scheduler_type, warmup_steps=s.warmup_steps(),
                total_steps=s.optim.total_training_steps, min_lr_ratio=s.optim.min_lr_ratio,
                num_cycles=s.optim.num_cycles,
            )
        if s.need_ref and s.lora is None:  # with LoRA the reference is the actor with its adapters off
            self.ref_model = self._build_model(train=False)
        self._lora_scalings = lora_mod.lora_scalings(self.model) if s.lora is not None else {}
        with self.startup.phase("offload"):
            self._offload_if_asked()
        n_params = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        accel = device_layer.accelerator_module(s.device)
        return {"rank": self.rank, "dp_rank": self.dp_rank, "params": int(n_params), "trainable_params": int(trainable),
                "attn_implementation": self.attn_implementation,
                "device": str(self.device.torch_device), "device_name": self._device_name(),
                "memory": self.memory_report(),
                "allocated_bytes": int(accel.memory_allocated()) if accel is not None else 0}

    def _device_name(self) -> str:
        """The accelerator's name (its promised FLOP/s for perf/mfu/actor: utils/flops.py); the kind elsewhere."""
        if self.settings.device == "cuda":
            return torch.cuda.get_device_name(self.device.torch_device)
        return self.settings.device

    def _mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.settings.device == "cpu":
            return MixedPrecisionPolicy()  # float32 throughout
        return MixedPrecisionPolicy(param_dtype=DTYPES[self.settings.param_dtype],
                                    reduce_dtype=DTYPES[self.settings.reduce_dtype])

    def _build_model(self, *, train: bool):
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        from verl_async.models.loading import load_causal_lm

        s = self.settings
        which = "" if train else "ref_"  # the reference model's phases: ref_model_load, ref_fsdp_wrap
        with self.startup.phase(f"{which}model_load"):
            model = load_causal_lm(s.model_path, dtype=torch.float32, trust_remote_code=s.trust_remote_code,
                                   override_config=s.override_config, attn_implementation=self.attn_implementation)
        model.config.use_cache = False
        if s.true_on_policy_span is not None:  # before sharding: FSDP2 hooks the patched modules as they are
            make_invariant(model, s.true_on_policy_span)
            self.attn_implementation = ATTENTION_NAME
        if train and s.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not train:
            model.requires_grad_(False)
        elif s.lora is not None:  # adapters on the targeted layers, before sharding; only they train
            model = lora_mod.apply_lora(model, s.lora)
        on_accel = s.device != "cpu"
        offload = (s.offload_policy if train else s.ref_param_offload) and on_accel
        policy = CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()
        kwargs = dict(mesh=self.mesh, mp_policy=self._mp_policy(), offload_policy=policy,
                      reshard_after_forward=s.reshard_after_forward if train else True)
        layer_classes = _decoder_layer_classes(model)
        with self.startup.phase(f"{which}fsdp_wrap"):  # shards (and moves to the device) every decoder layer
            for module in model.modules():
                if type(module).__name__ in layer_classes:
                    fully_shard(module, **kwargs)
            fully_shard(model, **kwargs)
        model.train(train)
        return model

    # ------------------------------------------------------------------ offload (fsdp_config.param_offload / optimizer_offload)
    def _offload_if_asked(self) -> None:
        if self.settings.device == "cpu":
            return
        if self.settings.param_offload and not self.settings.offload_policy:
            self.model.to("cpu")
        if self.settings.optimizer_offload and not self.settings.offload_policy:
            self._move_optimizer("cpu")

    def _load_if_offloaded(self) -> None:
        if self.settings.device == "cpu":
            return
        if self.settings.param_offload and not self.settings.offload_policy:
            self.model.to(self.device.torch_device)

    def _move_optimizer(self, where: str | torch.device) -> None:
        offload.move_state(self.optimizer.state.values(), where)

    # ------------------------------------------------------------------ forward
    def _range(self, phase: str):
        """`record_function('verl::<phase>')` while profiling (verl_async.utils.profile_summary), else nothing."""
        return torch.profiler.record_function(f"verl::{phase}") if self._profiling else contextlib.nullcontext()

    def _forward(self, model, inp: ModelInputs, *, with_entropy: bool, use_ref: bool = False,
                 topk_ids: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
        """(logp [b,T], entropy [b,T] or None, anchor, top-k [b,T,K] or None): anchor is a zero that touches the
        whole graph; with `topk_ids` [b,T,K] (a teacher's top-k tokens, distillation) the student's log-probs of them.

        `use_ref`: the reference model's forward (its log-probs follow `ref.use_torch_compile`)."""
        compiled = self.settings.ref_use_torch_compile if use_ref else self.settings.use_torch_compile
        if self.sp is not None and inp.num_rows:
            if topk_ids is not None:  # refused at start-up (config/distillation.py); a guard, not a path
                raise NotImplementedError("top-k distillation with Ulysses sequence parallelism")
            return (*self._forward_sequence_parallel(model, inp, with_entropy=with_entropy, compiled=compiled), None)
        with self._range("inputs"):
            inp = inp.to(self.device.torch_device)
        with self._range("forward"):
            out = model(**inp.model_kwargs())
        logits = out.logits
        labels = inp.labels.to(logits.device)
        temperature = self.settings.temperature
        with self._range("logprob"):
            if self.settings.true_on_policy_span is not None:  # the engine's own kernel (fixed chunks)
                if with_entropy:
                    raw_logp, raw_ent = token_logprobs_and_entropy(logits, labels, temperature)
                else:
                    raw_logp, raw_ent = token_logprobs(logits, labels, temperature), None
            elif with_entropy:
                raw_logp, raw_ent = logprobs_and_entropy(logits, labels, temperature, use_torch_compile=compiled)
            else:
                raw_logp, raw_ent = logprobs_from_logits(logits, labels, temperature, use_torch_compile=compiled), None
        anchor = torch.where(torch.isfinite(raw_logp), raw_logp, torch.zeros_like(raw_logp)).sum() * 0.0
        logp = inp.scatter(raw_logp)
        ent = inp.scatter(raw_ent) if raw_ent is not None else None
        topk = None
        if topk_ids is not None:
            with self._range("distillation_topk"):
                topk = student_topk(logits, inp, topk_ids.to(logits.device), temperature)
        return logp, ent, anchor, topk

    def _forward_sequence_parallel(self, model, inp: ModelInputs, *, with_entropy: bool, compiled: bool
                                   ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """`_forward` with Ulysses: this rank's slice of the packed row through the model, the log-probs (and
        entropy) of every position gathered over the sp group, then read at the response positions as usual."""
        dev = self.device.torch_device
        cu = inp.varlen_kwargs["cu_seq_lens_q"]
        piece = slice_packed(inp.input_ids, inp.position_ids, cu, int(inp.varlen_kwargs["max_length_q"]), self.sp,
                             self.pad_token_id)
        with self._range("forward"), sequence_parallel(self.sp):
            out = model(input_ids=piece.input_ids.to(dev), position_ids=piece.position_ids.to(dev),
                        attention_mask=None, use_cache=False,
                        **{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in piece.varlen_kwargs.items()})
        labels = piece.labels.to(dev)
        temperature = self.settings.temperature
        with self._range("logprob"):
            if with_entropy:
                local_logp, local_ent = logprobs_and_entropy(out.logits, labels, temperature,
                                                             use_torch_compile=compiled)
            else:
                local_logp = logprobs_from_logits(out.logits, labels, temperature, use_torch_compile=compiled)
                local_ent = None
            keep = inp.logits_index.to(dev)
            raw_logp = gather_sequence(local_logp, self.sp)[:, keep]
            raw_ent = gather_sequence(local_ent, self.sp)[:, keep] if local_ent is not None else None
        anchor = torch.where(torch.isfinite(raw_logp), raw_logp, torch.zeros_like(raw_logp)).sum() * 0.0
        inp = inp.to(dev)
        return inp.scatter(raw_logp), (inp.scatter(raw_ent) if raw_ent is not None else None), anchor

    def _packed(self) -> bool:
        return self.settings.use_remove_padding

    def _inputs(self, batch: TensorDict, rows: Sequence[int]) -> ModelInputs:
        return build_model_inputs(batch, rows, packed=self._packed(), pad_token_id=self.pad_token_id,
                                  with_varlen_kwargs=self.attn_implementation in ("flash_attention_2", "varlen",
                                                                                  ATTENTION_NAME, ULYSSES))

    @torch.no_grad()
    def compute_log_prob(self, batch: TensorDict, micro_batches: list[list[int]], *, use_ref: bool = False,
                         calculate_entropy: bool = False) -> dict[str, Any]:
        """Log-probs (and entropy) of this rank's rows: {"rows", "log_probs" [n,T], "entropy" [n,T] | None}."""
        lora_ref = use_ref and self.settings.lora is not None  # the reference: the actor without its adapters
        model = log_prob_model(self.model, self.ref_model, use_ref and not lora_ref)
        self._load_if_offloaded()
        out = LogProbRows()
        adapters_off = self.model.disable_adapter() if lora_ref else contextlib.nullcontext()
        with eval_mode(model, after=self._offload_if_asked), adapters_off:
            for rows in micro_batches:
                logp, ent = self._forward(model, self._inputs(batch, rows), with_entropy=calculate_entropy,
                                          use_ref=use_ref)[:2]
                out.add(rows, logp, ent)
        return out.result(batch["responses"].shape[1], calculate_entropy)

    # ------------------------------------------------------------------ update
    def update(self, batch: TensorDict, plans: list[MiniBatchPlan], loss_keys: list[str],
               profile: Optional[dict] = None) -> dict[str, Any]:
        """One training step: every mini-batch of `plans` is one optimizer step (PPO epochs included).

        `batch` carries `loss_mask` (the response mask after rollout correction), and the
        [B,T] tensors named in `loss_keys`. Returns metrics (identical on all ranks).
        `profile={"dir": ..., "tag": ...}` runs this step under torch.profiler: the trace goes to
        `dir/<tag>_rank<r>.json.gz`, the summary to `perf/profile` (verl_async.utils.profile_summary).
        """
        die_in_update(self.config, self.rank, self.global_step + 1)  # debug.fail_trainer (fault drills)
        if not profile:
            return self._update(batch, plans, loss_keys)
        from verl_async.utils.profile_summary import profile_call

        trace = os.path.join(profile["dir"], f"{profile.get('tag', 'update')}_rank{self.rank}.json.gz")
        self._profiling = True
        try:
            summary, metrics = profile_call(lambda: self._update(batch, plans, loss_keys), device=self.settings.device,
                                            model=self.model, trace_path=trace)
        finally:
            self._profiling = False
        metrics["perf/profile"] = {"rank": self.rank, **summary}
        return metrics

    def _update(self, batch: TensorDict, plans: list[MiniBatchPlan], loss_keys: list[str]) -> dict[str, Any]:
        s = self.settings
        cfg = LossConfig.from_settings(s)
        horizon = max(s.response_length or 0, batch["responses"].shape[1])
        self._load_if_offloaded()
        if s.optimizer_offload and not s.offload_policy and s.device != "cpu":
            self._move_optimizer(self.device.torch_device)
        self.model.train()
        accel = device_layer.accelerator_module(s.device)
        if accel is not None:
            accel.reset_peak_memory_stats()
        lr = float(self.optimizer.param_groups[0]["lr"])
        # Like verl: entropy only when it is in the loss (it costs extra passes over [tokens, vocab]); for
        # logging, compute_log_prob(calculate_entropy=True) gives it at no extra forward.
        want_entropy = s.entropy_coeff != 0
        stats = UpdateStats()
        for step_index, plan in enumerate(plans):
            local = {k: 0.0 for k in METRIC_KEYS}
            bad = 0.0
            ratio_dev = 0.0  # first mini-batch: max |ratio - 1| (0.0 when old log-probs are this forward's)
            micro = plan.micro[self.dp_rank]
            for i, rows in enumerate(micro):
                with self._range("inputs"):
                    inp = self._inputs(batch, rows)
                stats.tokens += inp.num_tokens // self.settings.sp if rows else 0  # this rank's slice
                data = gather_rows(batch, rows, loss_keys) if rows else {}
                logp, ent, anchor, topk = self._forward(self.model, inp, with_entropy=want_entropy,
                                                        topk_ids=data.get("teacher_topk_ids"))
                loss = anchor
                if rows:
                    with self._range("loss"):
                        data = {k: v.to(logp.device) for k, v in data.items()}
                        if topk is not None:
                            data["student_topk_log_probs"] = topk
                        micro_loss, m, error = guarded_actor_loss(logp, ent, data, cfg, rows=rows,
                                                                  global_tokens=plan.num_tokens,
                                                                  global_seqs=plan.num_seqs,
                                                                  loss_scale_factor=horizon)
                    if error is not None:
                        bad = 1.0
                        stats.errors.append(error)
                    else:
                        loss = loss + micro_loss
                        for k, v in m.items():
                            local[k] += v
                    if step_index == 0:
                        ratio_dev = max(ratio_dev, ratio_deviation_max(logp.detach(), data["old_log_probs"],
                                                                       data["loss_mask"]))
                self._grad_sync(last=i == len(micro) - 1)
                # FSDP averages gradients over ranks; the shares are sums: undo the average.
                with self._range("backward"):
                    (loss * self.world_size).backward()
            with self._range("metrics"):
                # the ranks of an sp group hold the same shares: count each group once
                reduced = self._all_reduce_sum([local[k] / self.settings.sp for k in METRIC_KEYS] + [bad])
                if step_index == 0:
                    stats.first_ratio_dev = self._all_reduce_max(ratio_dev)
            step_metrics = dict(zip(METRIC_KEYS, reduced[:-1]))
            bad_any = reduced[-1] > 0 or not all(np.isfinite(v) for v in step_metrics.values())
            with self._range("grad_clip"):
                grad_norm = self._clip_grad_norm()
            skip = bad_any or not np.isfinite(grad_norm)
            if skip:
                reason = self._skip_reason(stats, bad_any)  # before the gradients are dropped
                self.optimizer.zero_grad(set_to_none=True)
                if self.rank == 0 or not stats.errors:
                    logger.warning("rank %d step %d: non-finite loss or grad norm (%s, grad_norm=%s): optimizer "
                                   "step skipped (%d skipped so far)", self.rank, self.global_step, reason, grad_norm,
                                   self.skipped_steps + stats.skipped + 1)
            else:
                with self._range("optimizer"):
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
            stats.add_step(step_metrics, grad_norm, skip)
        self.lr_scheduler.step()
        self.global_step += 1
        self.skipped_steps += stats.skipped
        if s.optimizer_offload and not s.offload_policy and s.device != "cpu":
            self._move_optimizer("cpu")
        self._offload_if_asked()
        return stats.metrics(s, lr=lr, total_skipped=self.skipped_steps, global_step=self.global_step)

    def _grad_sync(self, last: bool) -> None:
        """Before each backward of a mini-batch: reduce gradients only on its last micro-batch.

        `set_requires_gradient_sync(False)` skips the reduce-scatter (and its fp32 copy-in/out) of the
        non-last micro-batches: 1 per layer per optimizer step instead of one per micro-batch. Every rank
        runs the same number of micro-batches (dummies, `batching`), so all ranks reduce in the same backward.
        The price (torch 2.11-2.13 FSDPParam.to_accumulated_grad_if_needed): each parameter's UNSHARDED
        gradient stays on the device across the mini-batch, in `reduce_dtype` (4 bytes x all parameters per
        rank) — hence `fsdp_config.grad_accum_no_sync` (default true; false for runs that need that memory,
        e.g. with `offload_policy`). While accumulating, parameters stay unsharded only when
        `reshard_after_forward=false` (no extra peak then); the last backward always reshards.
        """
        sync = last or not self.settings.grad_accum_no_sync
        self.model.set_requires_gradient_sync(sync)
        self.model.set_reshard_after_backward(sync or self.settings.reshard_after_forward)

    def _skip_reason(self, stats: UpdateStats, bad_loss: bool) -> str:
        """Why a step is skipped; for gradients, the parameters whose local shard on THIS rank is non-finite."""
        if stats.errors:
            return stats.errors[-1]
        if bad_loss:
            return "non-finite loss"
        names = nonfinite_grads(self.model.named_parameters())
        return "non-finite gradients in " + (", ".join(names) or "no local shard of this rank")

    def _clip_grad_norm(self) -> float:
        """Global grad norm over the sharded (DTensor) grads; clip when finite.

        The norm is reduced on the accelerator even when FSDP keeps grads on the host
        (offload_policy): NCCL/HCCL cannot reduce CPU tensors (verl's fsdp2_clip_grad_norm_).
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if self.settings.device != "cpu":
            total = total.to(self.device.torch_device)
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()
        norm = float(total)
        if self.settings.grad_clip is not None and np.isfinite(norm):
            torch.nn.utils.clip_grads_with_norm_(params, self.settings.grad_clip, total)
        return norm

    # ------------------------------------------------------------------ weight sync / export
    def iter_full_params(self, dtype: Optional[torch.dtype] = None, *, to_cpu: bool = True,
                         every_rank: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) on rank 0 (`every_rank`: on every rank, each its own gathered copy: cuda_ipc
        serves each colocated replica from the rank on its GPU), on the host unless `to_cpu=False` (collective
        sync sends device tensors); every rank must iterate (the gathers are collective).

        Names are the HF module's `named_parameters()` (tied weights appear once, as the
        embedding), the names `load_weights` / `load_state_dict(strict=False)` expect.
        """
        self._load_if_offloaded()
        try:
            named = self._gathered_params(every_rank)
            if self.settings.lora is not None:  # W + alpha/r B A under the base model's names (trainer/lora.py)
                named = lora_mod.merged_weights(named, self._lora_scalings)
            for name, full in named:
                out = full.to(dtype or full.dtype)
                yield name, out.cpu() if to_cpu else out
        finally:
            self._offload_if_asked()

    def device_gather_seconds(self, dtype: Optional[str] = None) -> float:
        """Seconds to produce every weight on the device as the collective transports do (gathers, LoRA merges),
        without sending it: what `scripts/bench_lora.py` times. Collective: call it on every rank."""
        start = time.perf_counter()
        for _name, tensor in self.iter_full_params(self.sync_dtype(dtype), to_cpu=False):
            del tensor
        accel = device_layer.accelerator_module(self.settings.device)
        if accel is not None:
            accel.synchronize()
        return time.perf_counter() - start

    def _gathered_params(self, every_rank: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of every parameter on rank 0 (`every_rank`: on each rank), nothing elsewhere; every
        rank must iterate (gathers)."""
        device = self.device.torch_device
        for name, param in self.model.named_parameters():
            if hasattr(param, "full_tensor"):
                # host-offloaded shards (offload_policy) must visit the device: NCCL/HCCL gather device memory
                full = (param if param.device == device else param.to(device)).full_tensor()
            else:
                full = param.data
            if self.rank == 0 or every_rank:
                yield name, full.detach()
            del full

    def full_param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, full shape) in `iter_full_params` order, from metadata alone (DTensors know their global shape)."""
        shapes = [(n, tuple(p.shape)) for n, p in self.model.named_parameters()]
        return lora_mod.merged_shapes(shapes) if self.settings.lora is not None else shapes

    @property
    def hf_config(self) -> Any:
        return self.model.config

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, extra: Optional[dict] = None) -> None:
        """Sharded model + optimizer (torch.distributed.checkpoint), scheduler, step, RNG, `extra`; `huggingface/`
        (config, tokenizer, and the weights with save_contents hf_model), all before meta.json marks it complete."""
        import torch.distributed.checkpoint as dcp

        self.save_hf_beside(path)
        self._load_if_offloaded()
        if self.settings.lora is not None:
            self._save_lora_adapter(os.path.join(path, HF_SUBDIR, "lora_adapter"))
        os.makedirs(path, exist_ok=True)
        model_sd, optim_sd = self._state_dicts()
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(path, "dcp"))
        meta = {"backend": "fsdp"}
        if self.settings.lora is not None:  # the model merger merges the adapters with these scalings
            meta["lora"] = {"rank": self.settings.lora.rank, "alpha": self.settings.lora.alpha,
                            "scalings": self._lora_scalings}
        self._save_trainer_state(path, self.lr_scheduler.state_dict(), extra, meta)
        self._offload_if_asked()

    def _save_lora_adapter(self, folder: str) -> None:
        """The adapters alone as a peft folder (adapter_config.json, adapter_model.safetensors): what
        `actor_rollout_ref.model.lora_adapter_path` (and peft's `PeftModel.from_pretrained`) loads."""
        from safetensors.torch import save_file

        tensors = {}
        for name, param in self.model.named_parameters():
            if ".lora_" not in name:
                continue
            full = param.full_tensor() if hasattr(param, "full_tensor") else param.data  # collective
            if self.rank == 0:  # peft's saved names carry no adapter name
                tensors[name.replace(f".{lora_mod.ADAPTER}.", ".")] = full.detach().float().cpu().contiguous()
        if self.rank == 0:
            os.makedirs(folder, exist_ok=True)
            self.model.peft_config[lora_mod.ADAPTER].save_pretrained(folder)
            save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))

    def load(self, path: str) -> dict:
        """Restore what `save` wrote; returns its `extra`."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        self._trainer_state_file(path)
        self._load_if_offloaded()
        if self.settings.optimizer_offload and not self.settings.offload_policy and self.settings.device != "cpu":
            self._move_optimizer(self.device.torch_device)
        model_sd, optim_sd = self._state_dicts()  # the load target; every entry is overwritten below
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        trainer_state = self._load_trainer_state(path)
        self.lr_scheduler.load_state_dict(trainer_state["lr_scheduler"])
        if self.world_size > 1:
            dist.barrier()
        self._offload_if_asked()
        return dict(trainer_state.get("extra") or {})

    def _state_dicts(self) -> tuple[dict, dict]:
        """`get_state_dict(model, optimizer)` without its side effect on an optimizer that never stepped.

        An optimizer without state (no `optimizer.step()` yet: a fresh start, or only skipped steps) gets one
        from `torch.distributed.checkpoint.state_dict._init_optim_state`: a `step()` with zero gradients at
        lr 0. The weights and AdamW's moments stay 0, but AdamW's `step` counter becomes 1, so the first real
        step would run as step 2 (bias corrections 1 - beta**2: ~0.74 of a fresh Adam's first step) in this
        run after a save, and in every run that loads that checkpoint. Counter 0 with zero moments is exactly
        the state a fresh AdamW creates in its first step: saving (and resuming) changes nothing.
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict

        fresh = not self.optimizer.state
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if fresh:
            for state in (*self.optimizer.state.values(), *optim_sd.get("state", {}).values()):
                step = state.get("step")
                if isinstance(step, torch.Tensor):
                    step.zero_()
                elif step is not None:
                    state["step"] = 0
        return model_sd, optim_sd

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

