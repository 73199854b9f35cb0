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

from verl_async.sync.buckets import plan_from_wire
from verl_async.sync.collective import WeightSyncGroup, receive_buckets


def pack_tensor(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    """(dtype, shape, raw bytes): what survives vLLM's untyped msgpack of collective_rpc args unchanged
    (a bare tensor there arrives as a plain list on the GPU worker)."""
    t = t.detach().cpu().contiguous()
    return str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def unpack_tensor(dtype: str, shape: Sequence[int], data: bytes) -> torch.Tensor:
    kind = getattr(torch, dtype)
    if not data:
        return torch.empty(tuple(shape), dtype=kind)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(tuple(shape))


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

    def verl_async_load_bucket(self, bucket: Iterable[Sequence[Any]]) -> int:
        """Object-store path: one bucket of (name, *`pack_tensor`) rows sent through collective_rpc."""
        device = getattr(self, "device", None)
        items = []
        for name, *packed in bucket:
            t = unpack_tensor(*packed)
            items.append((name, t.to(device) if device is not None else t))
        self.verl_async_model().load_weights(items)
        return len(items)

    def verl_async_leave_weight_sync(self) -> None:
        if self.verl_async_group is not None:
            self.verl_async_group.close()
            self.verl_async_group = None
