"""One Megatron-core training rank: GPT stage (TP shard), DDP, Megatron optimizer and schedule.

A plain class: `MegatronWorkerGroup` wraps it as a Ray actor (one per device) and
drives it exactly like an FSDP rank (same calls, same plan); a test may drive it
in-process. All ranks of one model replica (its TP x PP ranks) get the same part of
the plan (`dp_rank`), so every micro-batch runs through megatron-core's
forward/backward schedule (pipelined when PP > 1) on every rank of the replica.

Data layout: rows are right-padded (`batching.build_right_padded_inputs`): Megatron's
RoPE takes positions from the token index, and with the padding at the end plain
causal attention is exact, so no attention mask is built (`model.use_remove_padding` and
`model.attn_implementation` are FSDP settings and have no effect here).

Loss scaling: each micro-batch loss is its exact share of the mini-batch loss (see
`trainer.loss`); megatron-core's schedule divides by the number of micro-batches and
its DDP averages over data-parallel ranks, so the share is multiplied by both.

Precision: parameters and compute in `megatron.dtype` (bf16) on accelerators with
fp32 main parameters/gradients in the optimizer (megatron-core's mixed-precision
optimizer), float32 throughout on CPU.

Offload (`megatron.param_offload / grad_offload / optimizer_offload`, `ref.megatron.param_offload`):
between calls the DDP parameter / gradient buffers are freed on the device
(`storage().resize_(0)`, parameters keep a host copy) and the optimizer's fp32 main
parameters and states move to the host; each call brings back what it needs.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from verl_async.algos import logprobs_and_entropy, logprobs_from_logits
from verl_async.trainer import offload
from verl_async.trainer.batching import MiniBatchPlan, ModelInputs, build_right_padded_inputs, gather_rows
from verl_async.checkpoint import COMPLETE_MARKER
from verl_async.trainer.common import DTYPES, RankBase, eval_mode, log_prob_model
from verl_async.trainer.rank_results import METRIC_KEYS, LogProbRows, UpdateStats
from verl_async.trainer.loss import LossConfig, guarded_actor_loss
from verl_async.trainer.megatron import device_shim
from verl_async.trainer.megatron.convert import check_parallel, model_spec
from verl_async.trainer.megatron.settings import MegatronSettings
from verl_async.trainer.settings import TrainerSettings
from verl_async.utils import device as device_layer
from verl_async.utils.startup import StartupClock

if TYPE_CHECKING:  # tensordict (and torch._dynamo under it) loads with the first batch, not at start-up
    from tensordict import TensorDict

logger = logging.getLogger(__name__)


class MegatronWorker(RankBase):
    """One rank. Call order: `master_address()` (rank 0) -> `init(addr, port)` on all ranks -> work."""

    def __init__(self, config: dict, rank: int, world_size: int):
        self._startup = StartupClock()  # utils/startup.py
        self.config = config
        self.settings = TrainerSettings.from_config(config)
        self.ms = MegatronSettings.from_config(config, self.settings)
        self.rank, self.world_size = rank, world_size
        self.global_step = 0
        self.skipped_steps = 0
        self.model: Any = None  # megatron DDP wrapper of this rank's GPT stage
        self.ref_model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.notes: list[str] = []
        self.compute_dtype = self.ms.dtype
        self._host_params: dict[str, list] = {}  # offloaded storages: (tensor, host copy, bytes)

    def _mode(self):
        return device_shim.device_mode(self.settings.device)

    # ------------------------------------------------------------------ setup
    def init(self, master_addr: str, master_port: int) -> dict[str, Any]:
        device_shim.prepare(self.settings.device)  # before megatron-core is imported
        with self.startup.phase("dist_init"):
            self._init_distributed(master_addr, master_port)
        with self._mode(), self.startup.phase("megatron_init"):  # parallel state, model, optimizer
            return self._init_megatron()

    def _init_megatron(self) -> dict[str, Any]:
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from verl_async.models.loading import load_hf_config
        from verl_async.trainer.megatron import model as mmodel
        from verl_async.trainer.megatron.overrides import (
            optimizer_overrides,
            probe_platform,
            sequence_parallel_allowed,
            transformer_overrides,
        )

        s, ms = self.settings, self.ms
        mpu.initialize_model_parallel(tensor_model_parallel_size=ms.tp, pipeline_model_parallel_size=ms.pp,
                                      context_parallel_size=ms.cp, expert_model_parallel_size=ms.ep)
        model_parallel_cuda_manual_seed(ms.seed)
        self.tp_rank, self.pp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
        self.dp_rank = mpu.get_data_parallel_rank()
        self.dp_size = mpu.get_data_parallel_world_size()
        self.first_stage, self.last_stage = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
        self.hf_config = load_hf_config(s.model_path, trust_remote_code=s.trust_remote_code,
                                        override_config=s.override_config)
        self.spec = model_spec(self.hf_config)
        check_parallel(self.spec, ms.tp, ms.pp)
        self.pad_token_id = int(getattr(self.hf_config, "pad_token_id", None) or 0)
        self.dtype = torch.float32 if s.device == "cpu" else DTYPES[ms.dtype]
        platform = probe_platform(s.device)
        tc_kwargs, notes = transformer_overrides(ms.override_transformer_config, mmodel.transformer_config_fields(),
                                                 platform)
        self.sequence_parallel, sp_note = sequence_parallel_allowed(ms.sequence_parallel, ms.tp, platform)
        opt_kwargs, opt_notes = optimizer_overrides(ms.override_optimizer_config, mmodel.optimizer_config_fields(),
                                                    platform)
        self.notes = notes + ([sp_note] if sp_note else []) + opt_notes
        if self.rank == 0:
            for note in self.notes:
                logger.warning("%s", note)
        self.tconfig = mmodel.transformer_config(self.spec, ms, tc_kwargs, dtype=self.dtype, device=s.device,
                                                 sequence_parallel=self.sequence_parallel)
        self.model = self._build(train=True)
        self._build_optimizer(opt_kwargs)
        if s.need_ref:
            self.ref_model = self._build(train=False)
        self.layout = mmodel.gather_layout(self.dp_rank, self.tp_rank, self.pp_rank, self.world_size)
        self._hf_shapes = mmodel.hf_param_shapes(self._module(self.model), self.spec, self.layout)
        self._offload_if_asked()
        n_params = sum(p.numel() for p in self._module(self.model).parameters())
        return {"rank": self.rank, "dp_rank": self.dp_rank, "tp_rank": self.tp_rank, "pp_rank": self.pp_rank,
                "params": int(n_params), "device": str(self.device.torch_device), "notes": list(self.notes),
                "sequence_parallel": self.sequence_parallel, "memory": self.memory_report()}

    def _build(self, *, train: bool):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from verl_async.trainer.megatron import model as mmodel

        gpt = mmodel.build_gpt(self.spec, self.tconfig, self.ms.tp)
        if self.settings.device != "cpu":
            gpt = gpt.to(self.device.torch_device)
        mmodel.load_hf_weights(gpt, self.spec, self.settings.model_path, self.tp_rank, self.ms.tp)
        if not train:
            gpt.requires_grad_(False)
            gpt.eval()
            return gpt
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=self.ms.use_distributed_optimizer)
        return DistributedDataParallel(self.tconfig, ddp_config, gpt)

    def _build_optimizer(self, overrides: dict[str, Any]) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        s, ms = self.settings, self.ms
        o = s.optim
        config = OptimizerConfig(
            optimizer=ms.optimizer, lr=o.lr, min_lr=ms.min_lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
            adam_beta2=o.betas[1], adam_eps=o.eps, clip_grad=s.grad_clip or 0.0, bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16, params_dtype=self.dtype,
            use_distributed_optimizer=ms.use_distributed_optimizer, **overrides,
        )
        self.optimizer = get_megatron_optimizer(config, [self.model])
        warmup, decay = ms.scheduler_steps(s)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=ms.lr_warmup_init, max_lr=o.lr, min_lr=ms.min_lr, lr_warmup_steps=warmup,
            lr_decay_steps=decay, lr_decay_style=ms.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=decay, wd_incr_style=ms.weight_decay_incr_style, use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True, wsd_decay_steps=ms.lr_wsd_decay_steps,
            lr_wsd_decay_style=ms.lr_wsd_decay_style,
        )
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.tconfig.no_sync_func = self.model.no_sync
        if self.dtype == torch.float16:
            self.tconfig.grad_scale_func = self.optimizer.scale_loss

    @staticmethod
    def _module(model: Any) -> torch.nn.Module:
        return getattr(model, "module", model)

    # ------------------------------------------------------------------ offload
    def _ddp_buffers(self) -> list:
        return list(self.model.buffers) + list(getattr(self.model, "expert_parallel_buffers", []) or [])

    def _offload_if_asked(self) -> None:
        # Also on CPU (a host-to-host copy there): the CPU tests exercise the same code path.
        ms = self.ms
        if ms.optimizer_offload:  # first: it tells its own storage from the model's while both are allocated
            self._move_optimizer("cpu")
        if ms.param_offload:
            self._offload_storage("actor", self._param_storages(ref=False), keep=True)
        if ms.grad_offload:
            self._offload_storage("grads", [b.grad_data for b in self._ddp_buffers() if b.grad_data is not None],
                                  keep=False)
        if self.ref_model is not None and ms.ref_param_offload:
            self._offload_storage("ref", self._param_storages(ref=True), keep=True)
        device_layer.empty_cache(self.settings.device)

    def _param_storages(self, *, ref: bool) -> list[torch.Tensor]:
        """Tensors owning the parameters' device memory: DDP's contiguous buffers, else each parameter."""
        if ref:
            return [p.data for p in self.ref_model.parameters()]
        buffers = [b.param_data for b in self._ddp_buffers() if getattr(b, "param_data", None) is not None]
        return buffers or [p.data for p in self._module(self.model).parameters()]

    def _offload_storage(self, what: str, tensors: list[torch.Tensor], *, keep: bool) -> None:
        """Free the device memory of `tensors` (their views stay valid objects); `keep`: host copy first."""
        saved = self._host_params.setdefault(what, [])
        for t in tensors:
            nbytes = t.untyped_storage().size()
            if nbytes == 0:
                continue
            saved.append((t, t.detach().to("cpu", copy=True) if keep else None, nbytes))
            t.untyped_storage().resize_(0)

    def _restore_storage(self, what: str) -> None:
        for t, host, nbytes in self._host_params.pop(what, []):
            t.untyped_storage().resize_(nbytes)
            if host is None:
                t.zero_()
            else:
                t.copy_(host)

    def _load_if_offloaded(self, *, model: bool = True, grads: bool = False, optimizer: bool = False,
                           ref: bool = False) -> None:
        if model:
            self._restore_storage("actor")
        if ref:
            self._restore_storage("ref")
        if grads:
            self._restore_storage("grads")
        if optimizer and self.ms.optimizer_offload:
            self._move_optimizer(self.device.torch_device)

    def _move_optimizer(self, where: Any) -> None:
        """Main (fp32) parameters and optimizer states of every sub-optimizer to `where`."""
        subs = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        # fp32 model parameters sit in the optimizer as views of DDP's buffer: the model's, not moved here
        model = offload.storage_ptrs([*self._param_storages(ref=False), *self._module(self.model).parameters()])
        for sub in subs:
            inner = getattr(sub, "optimizer", None)
            if inner is None:
                continue
            offload.move_params((p for group in inner.param_groups for p in group["params"]), where,
                                model_storages=model)
            offload.move_state(inner.state.values(), where)

    # ------------------------------------------------------------------ forward
    def _inputs(self, batch: TensorDict, rows: Sequence[int]) -> ModelInputs:
        multiple = self.ms.tp if self.sequence_parallel else 1
        return build_right_padded_inputs(batch, rows, pad_token_id=self.pad_token_id, multiple_of=multiple)

    def _log_probs(self, output: torch.Tensor, inp: ModelInputs, *, with_entropy: bool, use_ref: bool = False
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """(logp [b,T], entropy [b,T] or None, anchor) from the last stage's logits [b, L, V_padded].

        `use_ref`: the reference model's output (its log-probs follow `ref.use_torch_compile`)."""
        logits = output[:, inp.logits_index.to(output.device), : self.spec.vocab_size]
        labels = inp.labels.to(output.device)
        t = self.settings.temperature
        compiled = self.settings.ref_use_torch_compile if use_ref else self.settings.use_torch_compile
        if with_entropy:
            raw_logp, raw_ent = logprobs_and_entropy(logits, labels, t, use_torch_compile=compiled)
        else:
            raw_logp, raw_ent = logprobs_from_logits(logits, labels, t, use_torch_compile=compiled), None
        anchor = torch.where(torch.isfinite(raw_logp), raw_logp, torch.zeros_like(raw_logp)).sum() * 0.0
        inp_dev = inp.to(output.device)
        return inp_dev.scatter(raw_logp), (inp_dev.scatter(raw_ent) if raw_ent is not None else None), anchor

    def _run_schedule(self, model: Any, items: list[tuple[ModelInputs, Any]], loss_fn, *, forward_only: bool) -> None:
        """megatron-core's forward(/backward) schedule over `items` (pipelined across stages when PP > 1).

        `items` are (inputs, rows) per micro-batch; `loss_fn(output, inputs, rows)` runs on the last
        stage and returns the loss to backpropagate.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = self.device.torch_device

        def step(data_iterator, module):
            inp, rows = next(data_iterator)
            output = module(inp.input_ids.to(device), inp.position_ids.to(device), None)

            def finish(out):
                return loss_fn(out, inp, rows), {}

            return output, finish

        longest = max(int(inp.input_ids.shape[1]) for inp, _ in items)
        widest = max(int(inp.input_ids.shape[0]) for inp, _ in items)
        get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(items), model=[model], num_microbatches=len(items),
            seq_length=longest, micro_batch_size=widest, forward_only=forward_only,
        )

    @torch.no_grad()
    def compute_log_prob(self, batch: TensorDict, micro_batches: list[list[int]], *, use_ref: bool = False,
                         calculate_entropy: bool = False) -> dict[str, Any]:
        """Log-probs (and entropy) of this replica's rows; only the last stage's TP rank 0 returns rows."""
        model = log_prob_model(self.model, self.ref_model, use_ref)
        out = LogProbRows()

        def collect(output, inp, rows):
            logp, ent, anchor = self._log_probs(output, inp, with_entropy=calculate_entropy, use_ref=use_ref)
            if self.last_stage and self.tp_rank == 0:  # one copy per model replica
                out.add(rows, logp, ent)
            return anchor

        items = [(self._inputs(batch, rows), rows) for rows in micro_batches]
        with self._mode():
            self._load_if_offloaded(model=not use_ref, ref=use_ref)
            with eval_mode(self._module(model), after=self._offload_if_asked):
                self._run_schedule(model, items, collect, forward_only=True)
        return out.result(batch["responses"].shape[1], calculate_entropy)

    # ------------------------------------------------------------------ update
    def _grads_finite(self) -> bool:
        return all(bool(torch.isfinite(buf.grad_data).all()) for buf in self._ddp_buffers()
                   if buf.grad_data is not None and buf.grad_data.numel())

    def update(self, batch: TensorDict, plans: list[MiniBatchPlan], loss_keys: list[str]) -> dict[str, Any]:
        """One training step: every mini-batch of `plans` is one optimizer step (PPO epochs included)."""
        with self._mode():
            return self._update(batch, plans, loss_keys)

    def _update(self, batch: TensorDict, plans: list[MiniBatchPlan], loss_keys: list[str]) -> dict[str, Any]:
        s = self.settings
        cfg = LossConfig.from_settings(s)
        horizon = max(s.response_length or 0, batch["responses"].shape[1])
        self._load_if_offloaded(model=True, grads=True, optimizer=True)
        self._module(self.model).train()
        accel = device_layer.accelerator_module(s.device)
        if accel is not None:
            accel.reset_peak_memory_stats()
        lr = float(self.optimizer.param_groups[0]["lr"])
        want_entropy = s.entropy_coeff != 0
        reporter = self.last_stage and self.tp_rank == 0  # one copy of each micro-batch's loss per replica
        stats = UpdateStats()
        for plan in plans:
            micro = plan.micro[self.dp_rank]
            scale = float(len(micro) * self.dp_size)  # undo megatron's mean over micro-batches and DP ranks
            local = {k: 0.0 for k in METRIC_KEYS}
            bad = [0.0]

            def loss_fn(output, inp, rows, plan=plan, local=local, bad=bad):
                logp, ent, anchor = self._log_probs(output, inp, with_entropy=want_entropy)
                loss = anchor
                if rows:
                    data = {k: v.to(logp.device) for k, v in gather_rows(batch, rows, loss_keys).items()}
                    micro_loss, m, error = guarded_actor_loss(logp, ent, data, cfg, rows=rows,
                                                              global_tokens=plan.num_tokens, global_seqs=plan.num_seqs,
                                                              loss_scale_factor=horizon)
                    if error is not None:
                        bad[0] = 1.0
                        stats.errors.append(error)
                    else:
                        loss = loss + micro_loss
                        if reporter:
                            for k, v in m.items():
                                local[k] += v
                return loss * scale

            items = [(self._inputs(batch, rows), rows) for rows in micro]
            if self.first_stage and self.tp_rank == 0:
                stats.tokens += sum(inp.num_tokens for inp, rows in items if rows)
            self._run_schedule(self.model, items, loss_fn, forward_only=False)
            grads_bad = 0.0 if self._grads_finite() else 1.0
            reduced = self._all_reduce_sum([local[k] for k in METRIC_KEYS] + [bad[0] if reporter else 0.0, grads_bad])
            step_metrics = dict(zip(METRIC_KEYS, reduced[:len(METRIC_KEYS)]))
            skip = reduced[-2] > 0 or reduced[-1] > 0 or not all(np.isfinite(v) for v in step_metrics.values())
            grad_norm = float("nan")
            if not skip:
                ok, norm, _ = self.optimizer.step()
                grad_norm = float(norm) if norm is not None else float("nan")
                skip = not ok
            if skip and (self.rank == 0 or stats.errors):
                logger.warning("rank %d step %d: non-finite loss or gradients (%s): optimizer step skipped",
                               self.rank, self.global_step, stats.errors[-1] if stats.errors else "see the last stage")
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            stats.add_step(step_metrics, grad_norm, skip)
        self.scheduler.step(increment=1)
        self.global_step += 1
        self.skipped_steps += stats.skipped
        self._offload_if_asked()
        return stats.metrics(s, lr=lr, total_skipped=self.skipped_steps, global_step=self.global_step)

    # ------------------------------------------------------------------ weight sync / export
    def iter_full_params(self, dtype: Optional[torch.dtype] = None, *,
                         to_cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) on rank 0, on the host unless `to_cpu=False`; every rank must iterate (gathers
        over TP, sends over PP)."""
        from verl_async.trainer.megatron.model import iter_hf_weights

        with self._mode():
            self._load_if_offloaded(model=True)
            try:
                yield from iter_hf_weights(self._module(self.model), self.spec, self.layout, rank=self.rank,
                                           dtype=dtype or self.sync_dtype(), comm_device=self.device.torch_device,
                                           to_cpu=to_cpu)
            finally:
                self._offload_if_asked()

    def full_param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, full shape) in `iter_full_params` order, gathered at start-up: a collective sync plans its
        buckets from them on rank 0 without a gather."""
        return list(self._hf_shapes)

    # ------------------------------------------------------------------ checkpoints
    def _optimizer_state(self) -> list[dict]:
        """Each sub-optimizer's torch state and its (fp32 main) parameters: this rank's shard only."""
        out = []
        for sub in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
            inner = sub.optimizer
            scaler = getattr(sub, "grad_scaler", None)
            out.append({"inner": inner.state_dict(),
                        "main": [p.detach().cpu() for g in inner.param_groups for p in g["params"]],
                        "grad_scaler": scaler.state_dict() if scaler is not None else None})
        return out

    def _load_optimizer_state(self, saved: list[dict]) -> None:
        subs = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        if len(saved) != len(subs):
            raise ValueError(f"checkpoint holds {len(saved)} optimizer parts, this run builds {len(subs)}")
        for sub, part in zip(subs, saved):
            inner = sub.optimizer
            inner.load_state_dict(part["inner"])
            params = [p for g in inner.param_groups for p in g["params"]]
            for p, value in zip(params, part["main"], strict=True):
                p.data.copy_(value)
            if part["grad_scaler"] is not None and getattr(sub, "grad_scaler", None) is not None:
                sub.grad_scaler.load_state_dict(part["grad_scaler"])

    def save(self, path: str, extra: Optional[dict] = None) -> None:
        """Per-rank files (model shard, optimizer shard, RNG) + trainer state; loading needs the same layout.

        `megatron/names_pp{p}.json` maps each stage's local parameter names to global ones (the model merger
        reads the shards without megatron-core); `huggingface/` as in RankBase.save_hf_beside.
        """
        from verl_async.trainer.megatron.model import global_names

        self.save_hf_beside(path)
        with self._mode():
            self._load_if_offloaded(model=True, optimizer=True)
            folder = os.path.join(path, "megatron")
            os.makedirs(folder, exist_ok=True)
            if self.dp_rank == 0:
                module = self._module(self.model)
                torch.save(module.state_dict(), os.path.join(folder, f"model_tp{self.tp_rank}_pp{self.pp_rank}.pt"))
                if self.tp_rank == 0:
                    with open(os.path.join(folder, f"names_pp{self.pp_rank}.json"), "w") as f:
                        json.dump(global_names(module), f)
            torch.save(self._optimizer_state(), os.path.join(folder, f"optimizer_rank{self.rank}.pt"))
            self._save_trainer_state(path, self.scheduler.state_dict(), extra,
                                     {"backend": "megatron", "layout": self.ms.layout(self.dp_size)})
            self._offload_if_asked()

    def load(self, path: str) -> dict:
        """Restore what `save` wrote (same TP/PP/DP layout); returns its `extra`."""
        self._trainer_state_file(path)
        meta_file = os.path.join(path, COMPLETE_MARKER)
        if not os.path.exists(meta_file):
            raise FileNotFoundError(f"no complete trainer checkpoint at {path!r} (missing {COMPLETE_MARKER})")
        with open(meta_file) as f:
            meta = json.load(f)
        self.ms.check_checkpoint(path, meta, self.dp_size)
        with self._mode():
            self._load_if_offloaded(model=True, optimizer=True)
            folder = os.path.join(path, "megatron")
            where = self.device.torch_device
            model_file = os.path.join(folder, f"model_tp{self.tp_rank}_pp{self.pp_rank}.pt")
            self._module(self.model).load_state_dict(torch.load(model_file, map_location=where, weights_only=True))
            self._load_optimizer_state(torch.load(os.path.join(folder, f"optimizer_rank{self.rank}.pt"),
                                                  map_location="cpu", weights_only=False))
            trainer_state = self._load_trainer_state(path)
            self.scheduler.num_steps = 0  # megatron's load_state_dict adds the saved steps to the current ones
            self.scheduler.load_state_dict(trainer_state["lr_scheduler"])
            if self.world_size > 1:
                dist.barrier()
            self._offload_if_asked()
        return dict(trainer_state.get("extra") or {})

    def shutdown(self) -> None:
        try:
            from megatron.core import parallel_state as mpu

            mpu.destroy_model_parallel()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
