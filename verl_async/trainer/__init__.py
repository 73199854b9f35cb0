"""Trainer engine room: the FSDP2 worker group and what it is made of.

`FSDPWorkerGroup` (Ray actors, one per device) is what the pipeline's Trainer drives;
`FSDPWorker` is one rank as a plain class; `prepare` is a step's algorithm on the driver
(old/ref log-probs, KL, advantages, rollout correction), `batching` plans the data path,
`loss` is the per-micro-batch actor loss, `checkpoint` the folder layout and rotation.
"""

from verl_async.versions import check_transformers

check_transformers()  # before any model is built: outside the supported range, say so (verl_async/versions.py)

from verl_async.checkpoint import checkpoint_dir, latest_checkpoint, mark_latest, rotate_checkpoints
from verl_async.trainer.fsdp_worker import FSDPWorker
from verl_async.trainer.settings import TrainerSettings
from verl_async.trainer.worker_group import FSDPWorkerGroup, RayWorkerGroup, WorkerGroupError

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
