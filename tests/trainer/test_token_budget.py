"""Micro-batch token budgets sized to the device (trainer/token_budget.py), against hand-computed values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verl_async.trainer.token_budget import bytes_per_token, device_budget, fitting_tokens, model_shape, unset_budgets

QWEN05 = {"layers": 24, "hidden": 896, "vocab": 151936}  # the measured shape (bench/RESULTS.md)
GIB = 2**30


def test_bytes_per_token_by_hand():
    assert bytes_per_token(24, 896, 151936) == 34 * 24 * 896 + 5 * 151936 == 1_490_816
    assert bytes_per_token(24, 896, 151936, gradient_checkpointing=True) == 34 * 896 + 5 * 151936


@pytest.mark.parametrize("free_gib, longest, expected", [
    (72, 512, 32768),   # 0.7 * 72 GiB / 1.49 MB = 36,300 tokens -> capped at 32768
    (20, 512, 8192),    # 10,083 -> 8192
    (2, 512, 4096),     # 1,008 -> the floor, 4096
    (20, 10000, 10000),  # a sequence is never split: at least the longest one
    (0, 0, 4096),
])
def test_fitting_tokens_is_a_clamped_power_of_two(free_gib, longest, expected):
    assert fitting_tokens(free_gib * GIB, bytes_per_token(**QWEN05), longest) == expected


def test_the_budget_fits_the_rank_with_the_least_memory():
    reports = [{"free_bytes": 72 * GIB, **QWEN05}, {"free_bytes": 20 * GIB, **QWEN05}]
    tokens, why = device_budget(reports, longest_sequence=768)
    assert tokens == 8192
    assert "20.0 GiB free" in why and "1.42 MiB" in why


def test_model_shape_reads_text_models_and_nested_text_configs():
    plain = SimpleNamespace(num_hidden_layers=30, hidden_size=576, vocab_size=49152)
    assert model_shape(plain) == {"layers": 30, "hidden": 576, "vocab": 49152}
    assert model_shape(SimpleNamespace(text_config=plain)) == {"layers": 30, "hidden": 576, "vocab": 49152}


def test_settings_leave_the_budget_to_the_accelerator_and_fix_it_on_cpu(tiny_model_dir):
    from tests.trainer.trainer_helpers import compose_config
    from verl_async.trainer.settings import TrainerSettings

    cpu = TrainerSettings.from_config(compose_config(tiny_model_dir))
    assert (cpu.ppo_max_token_len_per_gpu, cpu.log_prob_max_token_len_per_gpu,
            cpu.ref_log_prob_max_token_len_per_gpu) == (4096, 4096, 4096)
    assert unset_budgets(cpu) == [] and cpu.use_torch_compile is False
    gpu = TrainerSettings.from_config(compose_config(tiny_model_dir, "trainer.device=cuda"))
    assert unset_budgets(gpu) == ["ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu",
                                  "ref_log_prob_max_token_len_per_gpu"]
    assert gpu.use_torch_compile is True  # null: on for CUDA
    given = TrainerSettings.from_config(compose_config(
        tiny_model_dir, "trainer.device=cuda", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=12288",
        "actor_rollout_ref.actor.use_torch_compile=false"))
    assert given.ppo_max_token_len_per_gpu == given.log_prob_max_token_len_per_gpu == 12288
    assert given.use_torch_compile is False
