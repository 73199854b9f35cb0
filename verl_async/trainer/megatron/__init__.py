"""Megatron-core trainer backend (`actor_rollout_ref.actor.strategy=megatron`).

    convert       HF <-> Megatron names and TP shards (pure torch)
    settings      the `megatron.*` / Megatron optimizer keys
    overrides     override_transformer_config / override_optimizer_config -> megatron-core configs
    device_shim   megatron-core on NPU (torch_npu, MindSpeed) and CPU (tests)
    model         GPT stages from HF checkpoints, HF tensors back out (collective)
    worker        one rank (plain class);  worker_group  the Ray driver

Importing this package does not import megatron-core; `MegatronWorkerGroup` is loaded
on first use so that configs and conversion work without it.
"""

from __future__ import annotations

__all__ = ["MegatronWorkerGroup"]


def __getattr__(name: str):
    if name == "MegatronWorkerGroup":
        from verl_async.trainer.megatron.worker_group import MegatronWorkerGroup

        return MegatronWorkerGroup
    raise AttributeError(name)
