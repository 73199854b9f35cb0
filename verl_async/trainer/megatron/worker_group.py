"""Megatron-core worker group: the FSDP group's driver with Megatron ranks.

`actor_rollout_ref.actor.strategy=megatron` (config `fully_async_ppo_megatron_trainer`)
picks it in `verl_async.pipeline`. Same calls, same metrics, same weight-sync and
checkpoint interface as `FSDPWorkerGroup` (see `verl_async.trainer.worker_group`);
the data plan is split over the data-parallel size `world / (TP * PP)`, and all ranks
of one model replica get the same part.

The override keys are checked here, in the driver, before any actor starts: an
unknown `override_transformer_config.*` key fails at once with its name.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

from verl_async.optional import MEGATRON, require
from verl_async.checkpoint import COMPLETE_MARKER
from verl_async.trainer.megatron.settings import MegatronSettings
from verl_async.trainer.megatron.worker import MegatronWorker
from verl_async.trainer.worker_group import RayWorkerGroup
from verl_async.utils.shared_dirs import SharedDir


class MegatronWorkerGroup(RayWorkerGroup):
    worker_cls = MegatronWorker
    default_name = "megatron_actor"

    def __init__(self, config: Any, *, name: Optional[str] = None, shared_dirs: Sequence[SharedDir] = ()):
        super().__init__(config, name=name, shared_dirs=shared_dirs)
        from verl_async.trainer.megatron import device_shim

        device_shim.prepare(self.settings.device)  # on Ascend: torch_npu, MindSpeed before megatron-core
        require(MEGATRON)  # one clear error here, in the driver, before any rank starts
        self.megatron = MegatronSettings.from_config(self.config, self.settings)
        self.dp_size = self.world_size // self.megatron.model_parallel_size
        self._check_overrides()

    def _check_overrides(self) -> None:
        """Unknown / owned override keys fail in the driver (kernel availability is decided on each rank)."""
        from verl_async.trainer.megatron import model as mmodel
        from verl_async.trainer.megatron.overrides import Platform, optimizer_overrides, transformer_overrides

        everything = Platform(device="cuda", transformer_engine=True, apex=True, fused_softmax=True,
                              grad_accum_fusion=True, rope_fusion=True, fused_adam=True)
        transformer_overrides(self.megatron.override_transformer_config, mmodel.transformer_config_fields(),
                              everything)
        optimizer_overrides(self.megatron.override_optimizer_config, mmodel.optimizer_config_fields(), everything)

    def load(self, path: str) -> dict:
        """Restore a checkpoint of the same layout; another layout fails here, before any rank reads it."""
        meta_file = os.path.join(path, COMPLETE_MARKER)
        if not os.path.exists(meta_file):
            raise FileNotFoundError(f"no trainer checkpoint at {path!r} (missing {COMPLETE_MARKER})")
        with open(meta_file) as f:
            self.megatron.check_checkpoint(path, json.load(f), self.dp_size)
        return super().load(path)

    @property
    def notes(self) -> list[str]:
        """What the ranks turned off (fusions without kernels, sequence parallelism), from `init()`."""
        return list(self.info[0].get("notes", [])) if self.info else []
