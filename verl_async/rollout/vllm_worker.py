"""The part of the vLLM engine that runs inside vLLM's GPU worker processes.

vLLM mixes this class into its worker (`worker_extension_cls`), and `AsyncLLM.collective_rpc`
calls its methods on every worker (one per tensor-parallel rank). It deliberately imports no
vLLM: the worker gives it `self.rank`, `self.device` and `self.model_runner` (whose model's
`load_weights` takes HF-named tensors and does the TP sharding and q/k/v, gate/up stacking),
so tests drive it on CPU with a stand-in worker. All names carry a `verl_async_` prefix:
vLLM refuses extension attributes that collide with its worker's.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Optional, Sequence

import torch

from verl_async.sync_collective import WeightSyncGroup, plan_from_wire, receive_buckets


class WeightSyncWorkerExtension:
    verl_async_group: Optional[WeightSyncGroup] = None

    def verl_async_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        model = getattr(runner, "model", None)
        return model if model is not None else runner.get_model()

    def verl_async_join_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                                    timeout_s: float, name: str) -> int:
        """Join the sync group as rank `rank_offset + this worker's rank`; returns that rank."""
        self.verl_async_leave_weight_sync()
        rank = int(rank_offset) + int(self.rank)  # type: ignore[attr-defined]
        group = WeightSyncGroup(backend, host, port, rank, world_size, timeout_s, name=name)
        group.handshake()
        self.verl_async_group = group
        return rank

    def verl_async_receive_weights(self, plan_wire: Sequence, double_buffer: bool = True,
                                   verify: bool = False) -> dict[str, Any]:
        """Receive every bucket of the broadcast and load it into the model (generation is paused)."""
        if self.verl_async_group is None:
            raise RuntimeError("verl_async weight sync: receive before join")
        model = self.verl_async_model()
        checksums: dict[str, str] = {}
        t0 = time.perf_counter()
        tensors = 0
        for bucket in receive_buckets(self.verl_async_group, plan_from_wire(plan_wire), double_buffer=double_buffer,
                                      verify=verify, checksums=checksums):
            model.load_weights(bucket)
            tensors += len(bucket)
        return {"checksums": checksums, "seconds": time.perf_counter() - t0, "tensors": tensors,
                "rank": int(self.rank)}  # type: ignore[attr-defined]

    def verl_async_load_bucket(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Object-store path: one bucket of host tensors (sent through collective_rpc) into the model."""
        device = getattr(self, "device", None)
        items = [(name, t.to(device) if device is not None else t) for name, t in bucket]
        self.verl_async_model().load_weights(items)
        return len(items)

    def verl_async_leave_weight_sync(self) -> None:
        if self.verl_async_group is not None:
            self.verl_async_group.close()
            self.verl_async_group = None
