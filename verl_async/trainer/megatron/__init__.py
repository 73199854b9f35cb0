"""Megatron-core trainer backend (`actor_rollout_ref.actor.strategy=megatron`).

    convert       HF <-> Megatron names and TP shards (pure torch)
    settings      the `megatron.*` / Megatron optimizer keys
    overrides     override_transformer_config / override_optimizer_config -> megatron-core configs
    device_shim   megatron-core on NPU (torch_npu, MindSpeed) and CPU (tests)
    model         GPT stages from HF checkpoints, HF tensors back out (collective)
    worker        one rank (plain class);  worker_group  the Ray driver (MegatronWorkerGroup)

No module here imports megatron-core at import time, so configs and conversion work
without it; `MegatronWorkerGroup` asks for it when built (`verl_async.optional`).
"""
