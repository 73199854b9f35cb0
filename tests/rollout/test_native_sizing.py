"""max_num_seqs=null (issue 42, item 1): the native engine's slots from memory on CUDA, as vLLM sizes its batch."""

from __future__ import annotations

import asyncio

import pytest

from verl_async.models.loading import load_causal_lm
from verl_async.rollout.native import NativeEngine
from verl_async.rollout.native.sizing import DEFAULT_MAX_NUM_SEQS, MAX_AUTO_SLOTS, auto_slots, kv_bytes_per_token

GIB = 1 << 30


def test_kv_bytes_per_token_of_smollm2_135m_in_bf16():
    # 30 layers, 3 KV heads of 64: K and V, 2 bytes each
    assert kv_bytes_per_token(30, 3, 64, 2) == 2 * 30 * 3 * 64 * 2 == 23040


def test_slots_are_the_kv_budget_over_a_slot_capped():
    per_token, length = 23040, 512  # SmolLM2-135M bf16, the README command's 256 + 256
    # an 80 GiB H100 shared with the trainer: 0.5 x 80 = 40 GiB share, 10% reserve, 0.25 GiB weights
    slots, why = auto_slots(free_bytes=70 * GIB, total_bytes=80 * GIB, weight_bytes=GIB // 4,
                            gpu_memory_utilization=0.5, bytes_per_token=per_token, max_model_len=length)
    assert slots == MAX_AUTO_SLOTS and "capped at 512" in why
    # a smaller share: (0.05 x 80 x 0.9 - 0.25) GiB / (23040 x 512) bytes = 304.9 -> 304 slots
    slots, why = auto_slots(free_bytes=70 * GIB, total_bytes=80 * GIB, weight_bytes=GIB // 4,
                            gpu_memory_utilization=0.05, bytes_per_token=per_token, max_model_len=length)
    assert slots == int((0.05 * 80 * 0.9 - 0.25) * GIB // (per_token * length)) == 304
    assert why.startswith("304 slots of 512 tokens (3.34 GiB of KV cache) sized from memory: "
                          "gpu_memory_utilization=0.05 of 80.0 GiB, 70.0 GiB free, weights 0.25 GiB")


def test_never_more_than_is_free_and_always_one_slot():
    per_slot = 1 << 20
    # the share (0.9 x 80 GiB) is far more than the 2 GiB free: only free + own weights count
    slots, _ = auto_slots(free_bytes=2 * GIB, total_bytes=80 * GIB, weight_bytes=GIB, gpu_memory_utilization=0.9,
                          bytes_per_token=per_slot // 8, max_model_len=8, cap=100000)
    assert slots == int(((2 + 1) * GIB * 0.9 - GIB) // per_slot) == 1740
    slots, _ = auto_slots(free_bytes=GIB // 10, total_bytes=80 * GIB, weight_bytes=GIB, gpu_memory_utilization=0.5,
                          bytes_per_token=per_slot, max_model_len=8)
    assert slots == 1  # no room for the cache: one slot, the engine still starts


@pytest.mark.parametrize("kv_cache_tokens,slots", [(None, DEFAULT_MAX_NUM_SEQS), (5 * 64, 5)])
def test_on_cpu_null_means_64_or_the_kv_budget(tiny_model_dir, kv_cache_tokens, slots):
    model = load_causal_lm(tiny_model_dir)

    async def main():
        engine = NativeEngine(model=model, max_num_seqs=None, max_model_len=64, kv_cache_tokens=kv_cache_tokens)
        try:
            return engine.stats()
        finally:
            await engine.shutdown()

    stats = asyncio.run(main())
    assert stats.kv_budget_tokens == slots * 64
