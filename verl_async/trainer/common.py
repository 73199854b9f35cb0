"""What every trainer backend's rank does the same way (FSDP2 and Megatron share it).

The rendezvous, the RNG state a checkpoint keeps, the dtype weights leave in, and `RankBase`:
the distributed set-up, trainer-state save/load, and the one call weight sync makes on a rank
(`weight_sync`, verl_async/sync/). What a rank's calls return is in rank_results.py, the HF
folder `export_hf` writes in hf_export.py.
"""

from __future__ import annotations

import json
import os
import random
import socket
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from verl_async.sync import rank_weight_sync
from verl_async.trainer.hf_export import HF_SUBDIR, save_config_and_tokenizer, write_hf_folder
from verl_async.trainer.rank_results import no_reference_model
from verl_async.trainer.token_budget import free_device_bytes, model_shape
from verl_async.utils import device as device_layer
from verl_async.utils.shared_dirs import SharedDir, problem_here
from verl_async.utils.startup import StartupClock

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def free_port() -> int:
    """A port free on every interface: the rendezvous store listens on all of them, so a port free on
    the loopback alone may still be taken on the node's address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def master_address(nnodes: int) -> tuple[str, int]:
    """Where rank 0 listens: loopback on one node (its ranks share one placement bundle, so one node),
    this node's address across nodes (verl_async/placement.py puts rank 0 on the first node's bundle)."""
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


def dtype_name(dtype: torch.dtype) -> str:
    """The DTYPES key of `dtype` ("bfloat16"): how checkpoints record the dtype weights leave in."""
    return next(name for name, value in DTYPES.items() if value == dtype)


def weights_dtype(device: str, compute_dtype: str, dtype: Optional[str] = None) -> torch.dtype:
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

    @property
    def startup(self) -> StartupClock:
        """This rank's start-up phases (utils/startup.py); a subclass makes it first thing in `__init__`."""
        if getattr(self, "_startup", None) is None:
            self._startup = StartupClock()
        return self._startup

    def startup_report(self) -> dict[str, Any]:
        return self.startup.report()

    def node_problem(self, dirs: Sequence[SharedDir]) -> Optional[str]:
        """Whether this rank's node sees the folders the run shares (utils/shared_dirs.py); None: it does."""
        return problem_here(dirs, f"trainer rank {self.rank}")

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
        from verl_async.checkpoint import COMPLETE_MARKER

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
                           "model_path": self.settings.model_path, "hf_dtype": dtype_name(self.sync_dtype()),
                           **(meta or {})}, f)

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

    def memory_report(self) -> dict[str, Any]:
        """Free device memory now (model and optimizer built) and the model's shape: the driver sizes the
        micro-batch token budgets the config left null from it (token_budget.py)."""
        free = free_device_bytes(self.settings.device)
        return {} if free is None else {"free_bytes": free, **model_shape(self.hf_config)}

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

    def _all_reduce_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device.torch_device)
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def sync_dtype(self, dtype: Optional[str] = None) -> torch.dtype:
        """dtype the weights leave in (weight sync, HF export): asked for, else fp32 on CPU, compute dtype elsewhere."""
        return weights_dtype(self.settings.device, self.compute_dtype, dtype)

    def weight_sync(self, transport: str, step: str, *args: Any, **kwargs: Any) -> Any:
        """The one call weight sync makes on a rank: `step` of this rank's half of `transport` (verl_async/sync/)."""
        return rank_weight_sync(self, transport, step, *args, **kwargs)

    def weight_sync_stream(self, transport: str, step: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """`weight_sync` for steps that yield (Ray streams only from generator functions)."""
        yield from rank_weight_sync(self, transport, step, *args, **kwargs)

    def save_hf_beside(self, path: str) -> None:
        """`path/huggingface` of a checkpoint (verl's layout): config and tokenizer always (the model merger
        reads them), the weights too with `actor.checkpoint.save_contents` holding hf_model (collective then)."""
        folder = os.path.join(path, HF_SUBDIR)
        if self.settings.save_hf_model:
            self.export_hf(folder)
        elif self.rank == 0:
            save_config_and_tokenizer(folder, self.hf_config, self.settings)

    def export_hf(self, path: str, dtype: Optional[str] = None) -> Optional[str]:
        """A plain HF folder (config, safetensors, tokenizer) that `from_pretrained` loads; rank 0 writes."""
        target = self.sync_dtype(dtype)
        state = dict(self.iter_full_params(target))
        if self.rank == 0:
            write_hf_folder(path, self.hf_config, state, target, self.settings)
        if self.world_size > 1:
            dist.barrier()
        return path if self.rank == 0 else None
