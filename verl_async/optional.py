"""The optional heavy dependencies (vLLM, megatron-core, peft, Ascend's torch_npu and MindSpeed): imported where first
needed, one error when missing.

Everything else in verl_async is a plain import. These are extras (`pip install
'verl_async[vllm]'`, `'verl_async[megatron]'`, `'verl_async[npu]'`), large, and needed only by one
config choice each, so a run with the native engine and FSDP2 on CUDA or CPU never imports them.
Code that needs one calls `require(VLLM, "vllm.some.module")`: when the package is missing the
run stops with one message naming the config key that asked for it and the install line.
`try_import` is for a package that only improves a run when present (MindSpeed's NPU kernels).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Optional


@dataclass(frozen=True)
class OptionalDependency:
    package: str  # top-level import name
    needed_by: str  # the config choice that needs it, as the user writes it
    install: str  # how to get it


VLLM = OptionalDependency(
    "vllm", "actor_rollout_ref.rollout.name=vllm",
    "pip install 'verl_async[vllm]' (tested with vLLM 0.26.0), or scripts/device/prepare_vllm.sh",
)
MEGATRON = OptionalDependency(
    "megatron.core", "actor_rollout_ref.actor.strategy=megatron",
    "pip install 'verl_async[megatron]' (or MindSpeed's Megatron-LM on PYTHONPATH)",
)

PEFT = OptionalDependency(
    "peft", "actor_rollout_ref.model.lora_rank > 0 (LoRA)", "pip install 'verl_async[lora]' (peft)",
)


TORCH_NPU = OptionalDependency(
    "torch_npu", "trainer.device=npu", "pip install 'verl_async[npu]' on an Ascend host",
)
MINDSPEED = OptionalDependency(
    "mindspeed", "actor_rollout_ref.actor.strategy=megatron with trainer.device=npu",
    "MindSpeed on PYTHONPATH (optional: NPU kernels for megatron-core)",
)


class MissingDependencyError(ImportError):
    """An optional dependency that the config asks for is not installed (or does not import)."""


def is_installed(dependency: OptionalDependency) -> bool:
    """Whether the package can be found, without importing it (the preflight asks before Ray starts)."""
    try:
        return importlib.util.find_spec(dependency.package) is not None
    except ImportError:  # a parent package is missing ("megatron" for "megatron.core")
        return False


def require(dependency: OptionalDependency, module: Optional[str] = None) -> ModuleType:
    """Import `module` (default: the dependency's top-level package) or raise MissingDependencyError."""
    name = module or dependency.package
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{dependency.needed_by} needs {dependency.package}: {dependency.install} (import {name}: {exc})"
        ) from exc


def try_import(dependency: OptionalDependency, module: Optional[str] = None) -> Optional[ModuleType]:
    """Import `module` (default: the dependency's package), or None when it does not import: for a package that
    only improves a run when present."""
    try:
        return importlib.import_module(module or dependency.package)
    except ImportError:
        return None
