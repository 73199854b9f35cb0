"""Run megatron-core where `trainer.device` says, although megatron-core is written for CUDA.

* cuda: nothing to do.
* npu: Ascend's own route, as verl and MindSpeed use it: `torch_npu.contrib.transfer_to_npu`
  maps `torch.cuda.*` / `device="cuda"` to the NPU, and `mindspeed.megatron_adaptor`
  (when installed) patches megatron-core with NPU kernels. Both must be imported before
  megatron-core, so `prepare(kind)` runs first in every rank.
* cpu (tests, the CPU demo): megatron-core calls `torch.cuda.current_device()`, allocates
  with `device="cuda"`, asserts `tensor.type() == "torch.cuda.FloatTensor"` and keeps
  "CUDA" RNG states. `cpu_mode()` redirects exactly those to the CPU while it is active:
  a TorchFunctionMode rewrites device arguments and `Tensor.cuda()/.to("cuda")`,
  `Tensor.type()` reports the CUDA type name, and `torch.cuda`'s device/RNG queries and
  megatron's RNG-tracker helpers answer with the CPU ones. Numerics are unchanged:
  every op still runs the CPU kernel it would run anyway.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from verl_async.optional import MINDSPEED, TORCH_NPU, require, try_import


def prepare(kind: str) -> None:
    """Import what must precede megatron-core on this device kind (idempotent)."""
    if kind == "npu":
        require(TORCH_NPU)
        require(TORCH_NPU, "torch_npu.contrib.transfer_to_npu")
        # without MindSpeed: plain megatron-core on torch_npu (the local spec's PyTorch ops)
        try_import(MINDSPEED, "mindspeed.megatron_adaptor")


def _cpu(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a CUDA ordinal
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def _cpu_patches() -> dict[tuple[Any, str], Any]:
    import megatron.core.tensor_parallel.random as mrandom

    return {
        (torch.cuda, "current_device"): lambda: torch.device("cpu"),
        (torch.cuda, "synchronize"): lambda *a, **k: None,
        (torch.cuda, "get_rng_state"): lambda *a, **k: torch.get_rng_state(),
        (torch.cuda, "set_rng_state"): lambda state, *a, **k: torch.set_rng_state(state),
        # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
        (torch.cuda, "manual_seed"): lambda seed: torch.default_generator.manual_seed(int(seed)),
        (torch.cuda, "manual_seed_all"): lambda seed: None,
        (mrandom, "_get_cuda_rng_state"): lambda *a, **k: torch.get_rng_state(),
        (mrandom, "_set_cuda_rng_state"): lambda state, *a, **k: torch.set_rng_state(state),
    }


_depth = 0
_saved: dict[tuple[Any, str], Any] = {}


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """The CPU redirection of the module docstring (re-entrant; undone on exit)."""
    global _depth
    if _depth == 0:
        for (owner, name), fn in _cpu_patches().items():
            _saved[(owner, name)] = getattr(owner, name)
            setattr(owner, name, fn)
    _depth += 1
    try:
        with _CudaToCpu():
            yield
    finally:
        _depth -= 1
        if _depth == 0:
            for (owner, name), fn in _saved.items():
                setattr(owner, name, fn)
            _saved.clear()


def device_mode(kind: str):
    """Context for megatron-core calls: `cpu_mode()` on CPU, nothing elsewhere."""
    return cpu_mode() if kind == "cpu" else contextlib.nullcontext()
