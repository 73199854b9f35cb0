"""One place that knows about cuda / npu / cpu.

Every other module asks this one for the torch device, the distributed backend and
the accelerator namespace, so NPU support stays a handful of small branches here
instead of `if npu` spread over the code base. Importing this module never imports
torch_npu; it is imported lazily, and only when `trainer.device=npu` is asked for.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from verl_async.optional import TORCH_NPU, MissingDependencyError, require

DEVICE_KINDS = ("cuda", "npu", "cpu")
_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
# Environment variable that restricts which accelerators a process sees.
_VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES", "cpu": ""}
# Ray resource name of one accelerator of each kind.
_RAY_RESOURCE = {"cuda": "GPU", "npu": "NPU", "cpu": "CPU"}


class DeviceUnavailableError(RuntimeError):
    """The configured `trainer.device` cannot be used on this machine."""


@functools.lru_cache(maxsize=None)
def _import_torch_npu() -> ModuleType:
    try:
        return require(TORCH_NPU)
    except MissingDependencyError as exc:  # no Ascend stack here
        raise DeviceUnavailableError(str(exc)) from exc


def is_available(kind: str) -> bool:
    """Whether an accelerator of `kind` can be used in this process."""
    check_kind(kind)
    if kind == "cpu":
        return True
    if kind == "cuda":
        return torch.cuda.is_available()
    try:
        _import_torch_npu()
    except DeviceUnavailableError:
        return False
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def check_kind(kind: str) -> str:
    if kind not in DEVICE_KINDS:
        raise ValueError(f"trainer.device must be one of {DEVICE_KINDS}, got {kind!r}")
    return kind


@dataclass(frozen=True)
class DeviceSpec:
    """The accelerator a process runs on: kind plus local index."""

    kind: str
    index: int = 0

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, self.index)

    @property
    def dist_backend(self) -> str:
        return dist_backend(self.kind)

    def set_current(self) -> None:
        """Make this the process's current device (no-op on CPU)."""
        if self.kind == "cuda":
            torch.cuda.set_device(self.index)
        elif self.kind == "npu":
            _import_torch_npu()
            torch.npu.set_device(self.index)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.index)
        elif self.kind == "npu":
            torch.npu.synchronize(self.index)  # type: ignore[attr-defined]


def resolve(kind: str, index: int | None = None) -> DeviceSpec:
    """The device of `kind` ("cuda", or "cuda:1" as torch writes it) for this process; fails clearly when missing."""
    if ":" in kind:  # a torch device string: engines are handed str(torch.device)
        kind, _, number = kind.partition(":")
        if not number.isdigit():
            raise ValueError(f"device index must be a non-negative integer, got {number!r}")
        index = int(number) if index is None else index
    check_kind(kind)
    if kind == "npu":
        _import_torch_npu()
    if not is_available(kind):
        raise DeviceUnavailableError(f"trainer.device={kind} but no {kind} device is available in this process")
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", 0)) if kind == "cpu" else 0
    return DeviceSpec(kind, index if kind != "cpu" else 0)


def dist_backend(kind: str) -> str:
    """torch.distributed backend for a device kind (nccl / hccl / gloo)."""
    return _BACKENDS[check_kind(kind)]


def visible_devices_env(kind: str) -> str:
    return _VISIBLE_DEVICES_ENV[check_kind(kind)]


def ray_resource_name(kind: str) -> str:
    return _RAY_RESOURCE[check_kind(kind)]


def accelerator_module(kind: str) -> ModuleType | None:
    """`torch.cuda` or `torch.npu` (memory stats, streams, events); None on CPU."""
    check_kind(kind)
    if kind == "cuda":
        return torch.cuda
    if kind == "npu":
        _import_torch_npu()
        return torch.npu  # type: ignore[attr-defined]
    return None


def default_dtype(kind: str) -> torch.dtype:
    """Compute dtype: bf16 on accelerators, fp32 on CPU (exact tests, no bf16 matmul cost)."""
    return torch.float32 if check_kind(kind) == "cpu" else torch.bfloat16


def peak_memory_bytes(kind: str) -> int:
    mod = accelerator_module(kind)
    if mod is None:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return int(mod.max_memory_allocated())


def empty_cache(kind: str) -> None:
    mod = accelerator_module(kind)
    if mod is not None:
        mod.empty_cache()
