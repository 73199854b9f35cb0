"""What every trainer backend's rank does the same way (FSDP2 and Megatron share it).

Rendezvous address, RNG state for checkpoints, the update's metric bookkeeping
(which steps were skipped and why, exact mini-batch means), weight buckets for
parameter sync, and the HF folder that `export_hf` writes.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from verl_async.utils import device as device_layer
from verl_async.weight_bucket import PackedBucket

METRIC_KEYS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy",
               "actor/kl_loss", "actor/loss")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def master_address(nnodes: int) -> tuple[str, int]:
    """Where rank 0 listens: loopback on one node, this node's address across nodes."""
    if nnodes == 1:
        return "127.0.0.1", free_port()
    import ray

    return ray.util.get_node_ip_address(), free_port()


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Lists of (name, tensor) of at most `bucket_bytes` each (a larger tensor travels alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class LogProbRows:
    """Rows and their log-probs (and entropy) over a call's micro-batches, in `compute_log_prob`'s result form."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.logps: list[torch.Tensor] = []
        self.ents: list[torch.Tensor] = []

    def add(self, rows: Iterable[int], logp: torch.Tensor, ent: Optional[torch.Tensor]) -> None:
        rows = list(rows)
        if rows:  # an empty micro-batch is a dummy that kept this rank in step
            self.rows.extend(rows)
            self.logps.append(logp.float().cpu())
            if ent is not None:
                self.ents.append(ent.float().cpu())

    def result(self, width: int, calculate_entropy: bool) -> dict[str, Any]:
        empty = torch.zeros(0, width)
        return {"rows": self.rows, "log_probs": torch.cat(self.logps) if self.logps else empty,
                "entropy": (torch.cat(self.ents) if self.ents else empty) if calculate_entropy else None}


def no_reference_model() -> RuntimeError:
    return RuntimeError("compute_ref_log_prob: no reference model (actor.use_kl_loss and "
                        "algorithm.use_kl_in_reward are both false)")


def log_prob_model(model: Any, ref_model: Any, use_ref: bool) -> Any:
    """The model a rank's `compute_log_prob` runs: the reference (an error when none was built) or the actor."""
    chosen = ref_model if use_ref else model
    if chosen is None:
        raise no_reference_model()
    return chosen


@contextmanager
def eval_mode(module: torch.nn.Module, after: Callable[[], None]) -> Iterator[None]:
    """`module` in eval mode for a log-prob pass; then (error or not) its training flag back, and `after()`
    (the rank's offload, when the settings ask for one)."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)
        after()


class UpdateStats:
    """One `update()` call's bookkeeping: per-optimizer-step loss metrics, grad norms, skipped steps.

    Loss-type metrics arrive per step as exact mini-batch values (shares summed over
    micro-batches and ranks); the result averages the finite ones over the steps.
    """

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {k: [] for k in METRIC_KEYS}
        self.grad_norms: list[float] = []
        self.skipped = 0
        self.steps = 0
        self.errors: list[str] = []
        self.tokens = 0
        self.t0 = time.perf_counter()

    def add_step(self, step_metrics: dict[str, float], grad_norm: float, skipped: bool) -> None:
        self.steps += 1
        self.skipped += int(skipped)
        self.grad_norms.append(grad_norm)
        for k in METRIC_KEYS:
            if np.isfinite(step_metrics[k]):  # a skipped (overflowed) step would turn the mean into inf
                self.values[k].append(step_metrics[k])

    def metrics(self, settings: Any, *, lr: float, total_skipped: int, global_step: int) -> dict[str, Any]:
        s = settings
        out: dict[str, Any] = {k: float(np.mean(v)) if v else float("nan") for k, v in self.values.items()}
        if not s.use_kl_loss:
            out.pop("actor/kl_loss")
        if s.entropy_coeff == 0:
            out.pop("actor/entropy")
        finite_norms = [g for g in self.grad_norms if np.isfinite(g)]
        out.update({
            "actor/grad_norm": float(np.mean(finite_norms)) if finite_norms else float("nan"),
            "actor/lr": lr,
            "actor/skipped_steps": float(self.skipped),
            "actor/total_skipped_steps": float(total_skipped),
            "actor/optimizer_steps": float(self.steps - self.skipped),
            "actor/global_step": float(global_step),
            "perf/forward_tokens_rank": float(self.tokens),
            "perf/train_time_s": time.perf_counter() - self.t0,
            "perf/max_memory_allocated_gb": device_layer.peak_memory_bytes(s.device) / 2**30,
        })
        if s.use_kl_loss:
            out["actor/kl_coef"] = s.kl_loss_coef
        if self.errors:
            out["actor/skip_reasons"] = self.errors[:4]
        return out


def write_hf_folder(path: str, hf_config: Any, state: dict[str, torch.Tensor], dtype: torch.dtype,
                    settings: Any) -> str:
    """`save_pretrained` folder (config, safetensors, tokenizer) from full HF-named tensors."""
    from transformers import AutoModelForCausalLM

    from verl_async.models.loading import load_tokenizer

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=settings.trust_remote_code)
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(hf, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"export_hf: state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf.tie_weights()
    hf.config.use_cache = True
    os.makedirs(path, exist_ok=True)
    hf.save_pretrained(path)
    tok = load_tokenizer(settings.model_path, trust_remote_code=settings.trust_remote_code,
                         custom_chat_template=settings.custom_chat_template)
    tok.save_pretrained(path)
    return path


def nonfinite_grads(named_params: Iterable[tuple[str, torch.nn.Parameter]], limit: int = 5) -> list[str]:
    """Names of parameters whose (local shard of the) gradient holds inf/NaN: the first `limit`, then a count."""
    bad = []
    for name, p in named_params:
        grad = p.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local.numel() and not bool(torch.isfinite(local).all()):
            bad.append(name)
    return bad[:limit] + ([f"... {len(bad) - limit} more"] if len(bad) > limit else [])


def sync_dtype(device: str, compute_dtype: str, dtype: Optional[str] = None) -> torch.dtype:
    """dtype of synced / exported weights: asked for, else float32 on CPU and the compute dtype elsewhere."""
    if dtype:
        return DTYPES[dtype]
    return torch.float32 if device == "cpu" else DTYPES[compute_dtype]


class RankBase:
    """What an FSDP rank and a Megatron rank do alike. A subclass sets `settings`, `rank`,
    `world_size`, `device`, `optimizer`, and provides `iter_full_params(dtype)` (collective,
    rank 0 yields HF names), `hf_config` and `compute_dtype` (the dtype name on accelerators).
    """

    settings: Any
    rank: int
    world_size: int
    device: Any
    optimizer: Any
    compute_dtype: str

    def master_address(self) -> tuple[str, int]:
        return master_address(self.settings.nnodes)

    def _init_distributed(self, master_addr: str, master_port: int) -> None:
        """This rank's device and the default process group (nccl / hccl / gloo)."""
        s = self.settings
        self.device = device_layer.resolve(s.device)
        self.device.set_current()
        if s.device == "cpu":
            torch.set_num_threads(s.cpu_threads_per_worker)
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size))
        if not dist.is_initialized():
            dist.init_process_group(backend=self.device.dist_backend, rank=self.rank, world_size=self.world_size,
                                    init_method=f"tcp://{master_addr}:{master_port}",
                                    timeout=timedelta(seconds=max(60.0, s.worker_timeout_s)))

    def _save_trainer_state(self, path: str, scheduler_state: dict, extra: Optional[dict],
                            meta: Optional[dict] = None) -> None:
        """RNG (every rank), scheduler / step / `extra` (rank 0), then the completion marker, written last."""
        from verl_async.trainer.checkpoint import COMPLETE_MARKER

        torch.save(rng_state(), os.path.join(path, f"rng_rank{self.rank}.pt"))
        if self.rank == 0:
            torch.save({"lr_scheduler": scheduler_state, "global_step": self.global_step,
                        "skipped_steps": self.skipped_steps, "extra": extra or {}},
                       os.path.join(path, "trainer_state.pt"))
        if self.world_size > 1:
            dist.barrier()
        if self.rank == 0:
            with open(os.path.join(path, COMPLETE_MARKER), "w") as f:
                json.dump({"global_step": self.global_step, "world_size": self.world_size,
                           "model_path": self.settings.model_path, **(meta or {})}, f)

    @staticmethod
    def _trainer_state_file(path: str) -> str:
        state_file = os.path.join(path, "trainer_state.pt")
        if not os.path.exists(state_file):
            raise FileNotFoundError(f"no trainer checkpoint at {path!r} (missing trainer_state.pt)")
        return state_file

    def _load_trainer_state(self, path: str) -> dict:
        """Step counters and this rank's RNG back; returns the saved dict (`lr_scheduler`, `extra`)."""
        state = torch.load(self._trainer_state_file(path), weights_only=False)
        self.global_step = int(state["global_step"])
        self.skipped_steps = int(state["skipped_steps"])
        rng_file = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_file):
            set_rng_state(torch.load(rng_file, weights_only=False))
        return state

    def set_options(self, overrides: dict[str, Any]) -> None:
        self.settings = self.settings.with_overrides(overrides)

    def state(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "skipped_steps": self.skipped_steps,
                "lr": float(self.optimizer.param_groups[0]["lr"])}

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device.torch_device)
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu().tolist()

    def _sync_dtype(self, dtype: Optional[str] = None) -> torch.dtype:
        return sync_dtype(self.settings.device, self.compute_dtype, dtype)

    def weight_buckets(self, bucket_bytes: int, dtype: Optional[str] = None) -> Iterator[PackedBucket]:
        """Buckets of (HF name, tensor) of at most `bucket_bytes` (a larger tensor travels alone); rank 0 yields."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        for bucket in bucketize(self.iter_full_params(self._sync_dtype(dtype)), bucket_bytes):
            yield PackedBucket(bucket)  # raw bytes: the object store moves them without pickling tensors

    def send_weights_ipc(self, target: Any, receivers: int, version: int, bucket_bytes: int, timeout_s: float,
                         verify: bool = False, dtype: Optional[str] = None) -> dict:
        """cuda_ipc (verl_async/sync_ipc.py): every rank gathers; rank 0 packs each bucket on the device and ships
        its IPC handles to `target.load_ipc_bucket`, freeing the buffer once every replica has loaded it."""
        from verl_async.sync_ipc import send_buckets_ipc

        if self.settings.device != "cuda":
            raise RuntimeError(f"cuda_ipc needs trainer.device=cuda, got {self.settings.device}")
        named = self.iter_full_params(self._sync_dtype(dtype), to_cpu=False)
        return send_buckets_ipc(named, bucket_bytes, target, receivers, version, timeout_s=timeout_s, verify=verify,
                                is_sender=self.rank == 0)

    def export_hf(self, path: str, dtype: Optional[str] = None) -> Optional[str]:
        """A plain HF folder (config, safetensors, tokenizer) that `from_pretrained` loads; rank 0 writes."""
        target = self._sync_dtype(dtype)
        state = dict(self.iter_full_params(target))
        if self.rank == 0:
            write_hf_folder(path, self.hf_config, state, target, self.settings)
        if self.world_size > 1:
            dist.barrier()
        return path if self.rank == 0 else None
