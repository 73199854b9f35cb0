"""Trainer engine room: the FSDP2 worker group and what it is made of.

`FSDPWorkerGroup` (Ray actors, one per device) is what the pipeline's Trainer drives;
`FSDPWorker` is one rank as a plain class; `prepare` is a step's algorithm on the driver
(old/ref log-probs, KL, advantages, rollout correction), `batching` plans the data path,
`loss` is the per-micro-batch actor loss, `checkpoint` the folder layout and rotation.
"""

from verl_async.versions import check_transformers

check_transformers()  # before any model is built: outside the supported range, say so (verl_async/versions.py)

import importlib
from typing import Any

# name -> the module that defines it; loaded on first use, so that importing one light module of this package
# (settings, token_budget, ...) does not load torch, transformers' models and the FSDP worker with it
_EXPORTS = {
    "FSDPWorker": "verl_async.trainer.fsdp_worker",
    "FSDPWorkerGroup": "verl_async.trainer.worker_group",
    "RayWorkerGroup": "verl_async.trainer.worker_group",
    "WorkerGroupError": "verl_async.trainer.worker_group",
    "TrainerSettings": "verl_async.trainer.settings",
    "checkpoint_dir": "verl_async.checkpoint",
    "latest_checkpoint": "verl_async.checkpoint",
    "mark_latest": "verl_async.checkpoint",
    "rotate_checkpoints": "verl_async.checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FSDPWorker",
    "FSDPWorkerGroup",
    "RayWorkerGroup",
    "TrainerSettings",
    "WorkerGroupError",
    "checkpoint_dir",
    "latest_checkpoint",
    "mark_latest",
    "rotate_checkpoints",
]
