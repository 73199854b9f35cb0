"""actor_rollout_ref.rollout.true_on_policy: accepted where it can hold, refused in one line naming the key elsewhere."""

from __future__ import annotations

import pytest

from verl_async.config import ConfigError, compose, validate

ON = "actor_rollout_ref.rollout.true_on_policy=true"
MEGATRON = "fully_async_ppo_megatron_trainer"


def check(*overrides: str, name: str = "fully_async_ppo_trainer"):
    return validate(compose(name, [ON, *overrides]))


def test_accepted_with_the_native_engine_and_fsdp2_on_cpu():
    cfg = check()
    assert cfg.actor_rollout_ref.rollout.true_on_policy is True
    assert validate(compose("fully_async_ppo_trainer", [])).actor_rollout_ref.rollout.true_on_policy is False


@pytest.mark.parametrize("overrides, name, key, words", [
    (["actor_rollout_ref.rollout.name=vllm"], None, "actor_rollout_ref.rollout.true_on_policy", "native engine"),
    ([], MEGATRON, "actor_rollout_ref.rollout.true_on_policy", "FSDP2 trainer"),
    (["actor_rollout_ref.rollout.engine_kwargs.native.dtype=bfloat16"], None,
     "actor_rollout_ref.rollout.true_on_policy", "bfloat16 and the trainer in float32"),
    (["actor_rollout_ref.actor.use_torch_compile=true"], None, "actor_rollout_ref.actor.use_torch_compile",
     "change the arithmetic"),
    (["+actor_rollout_ref.rollout.engine_kwargs.native.compile_decode=true"], None,
     "actor_rollout_ref.rollout.engine_kwargs.native.compile_decode", "change the arithmetic"),
    (["actor_rollout_ref.model.attn_implementation=sdpa"], None, "actor_rollout_ref.model.attn_implementation",
     "its own attention"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "rollout.n_gpus_per_node=2"], None,
     "actor_rollout_ref.rollout.true_on_policy", "tensor_model_parallel_size=1"),
])
def test_refused_naming_the_key(overrides, name, key, words):
    with pytest.raises(ConfigError) as info:
        check(*overrides, name=name or "fully_async_ppo_trainer")
    assert info.value.key == key and words in str(info.value) and "\n" not in str(info.value)


def test_accelerator_dtypes_must_agree():
    from verl_async.config.true_on_policy import mode_dtypes

    cfg = compose("fully_async_ppo_trainer", [ON, "trainer.device=cuda", "actor_rollout_ref.rollout.dtype=float16"])
    assert mode_dtypes(cfg) == ("float16", "bfloat16")
    cfg = compose("fully_async_ppo_trainer", [ON, "trainer.device=cuda"])
    assert mode_dtypes(cfg) == ("bfloat16", "bfloat16")
    assert mode_dtypes(compose("fully_async_ppo_trainer", [ON])) == ("float32", "float32")


def test_an_unsupported_model_family_is_refused_before_start(tmp_path):
    import json

    from verl_async.config.preflight import check_model_folder

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    cfg = compose("fully_async_ppo_trainer", [ON, f"actor_rollout_ref.model.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.true_on_policy: model type 'gemma2'"):
        check_model_folder(cfg)


def test_a_model_too_wide_for_exact_sums_is_refused_before_start(tmp_path):
    import json

    from verl_async.config.preflight import check_model_folder

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                      "intermediate_size": 2 ** 22}))
    cfg = compose("fully_async_ppo_trainer", [ON, f"actor_rollout_ref.model.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.true_on_policy: .*intermediate_size=4194304"):
        check_model_folder(cfg)


def test_a_worker_on_a_cpu_of_another_capability_refuses(monkeypatch):
    from verl_async.invariant.shapes import CPU_CAPABILITY_ENV, cpu_capability, environment_problem, worker_env

    assert worker_env("cpu") == {CPU_CAPABILITY_ENV: cpu_capability()}
    monkeypatch.setenv(CPU_CAPABILITY_ENV, cpu_capability())
    assert environment_problem("cpu") is None
    monkeypatch.setenv(CPU_CAPABILITY_ENV, "NO_AVX")
    problem = environment_problem("cpu")
    assert problem.startswith("actor_rollout_ref.rollout.true_on_policy: ") and "NO_AVX" in problem
    assert "\n" not in problem
