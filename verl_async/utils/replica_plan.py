"""Where a model replica of the rollout side runs (a distillation teacher, a reward model): its own device, or a
device it shares with the engine replicas (the ids they share with the trainer), or a small CPU share."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from verl_async.utils import device as device_layer

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                "float32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True)
class ReplicaPlan:
    device: str  # cuda | npu | cpu
    pinned: Optional[Sequence[str]] = None  # device ids it shares (beside colocated engines); None: its own device

    def actor_options(self) -> dict[str, Any]:
        """Ray resources: its own accelerator, none (pinned: the ids are another actor's), or a small CPU share."""
        if self.device == "cpu":
            return {"num_cpus": 0.25}
        if self.pinned:
            return {"num_cpus": 1}
        if self.device == "cuda":
            return {"num_gpus": 1, "num_cpus": 1}
        return {"resources": {device_layer.ray_resource_name(self.device): 1}, "num_cpus": 1}

    def enter(self) -> torch.device:
        """In the replica's process, before the first accelerator call: pin the shared id, select the device."""
        if self.pinned and self.device != "cpu":
            os.environ[device_layer.visible_devices_env(self.device)] = str(self.pinned[0])
        spec = device_layer.resolve(self.device)
        spec.set_current()
        return spec.torch_device

    def dtype(self, name: str) -> torch.dtype:
        """The model dtype: as configured on an accelerator, float32 on CPU (as the engines)."""
        return TORCH_DTYPES[name] if self.device != "cpu" else torch.float32
