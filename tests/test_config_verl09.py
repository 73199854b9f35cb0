"""verl 0.9's layout beside the older one: each mapping against hand-computed values, each refusal in one line."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
from omegaconf import OmegaConf

from verl_async.algos.rollout_correction import rollout_correction
from verl_async.config import ConfigError, compose, reset_compat_warnings, validate
from verl_async.config.cli import REPO_ROOT
from verl_async.config.compat import ALIASES, unset
from verl_async.config.verl09 import parse_bounds, rollout_correction_from_verl

FSDP, MEGATRON = "fully_async_ppo_trainer", "fully_async_ppo_megatron_trainer"
RC = "algorithm.rollout_correction"


def check(overrides, name=FSDP):
    return validate(compose(name, overrides))


def refused(overrides, name=FSDP) -> str:
    with pytest.raises(ConfigError) as err:
        check(overrides, name)
    return str(err.value)


# --------------------------------------------------------------------------- the reward group
def test_reward_group_maps_onto_the_older_layout(tmp_path):
    scorer = tmp_path / "score.py"
    scorer.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    cfg = check(["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
                 "+reward.reward_kwargs.overlong_buffer_cfg.len=16", "+reward.reward_kwargs.max_resp_len=64",
                 f"reward.custom_reward_function.path={scorer}", "reward.custom_reward_function.name=my_score",
                 "reward.num_workers=3"])
    assert cfg.reward_model.reward_manager == "dapo" and cfg.reward_model.num_workers == 3
    assert OmegaConf.to_container(cfg.reward_model.reward_kwargs) == {
        "overlong_buffer_cfg": {"enable": True, "len": 16}, "max_resp_len": 64}
    assert (cfg.custom_reward_function.path, cfg.custom_reward_function.name) == (str(scorer), "my_score")
    # the older layout alone still works, and both set to the same value is fine
    old = check(["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.max_resp_len=64"])
    assert old.reward_model.reward_manager == "dapo" and old.reward.reward_manager.name is None
    assert check(["reward_model.num_workers=2", "reward.num_workers=2"]).reward_model.num_workers == 2


@pytest.mark.parametrize("overrides,line", [
    (["reward.num_workers=4", "reward_model.num_workers=2"],
     "reward.num_workers: 4 conflicts with reward_model.num_workers=2; set only one"),
    (["+reward.reward_kwargs.max_resp_len=64", "+reward_model.reward_kwargs.max_resp_len=32"],
     "reward.reward_kwargs: {'max_resp_len': 64} conflicts with reward_model.reward_kwargs={'max_resp_len': 32}; "
     "set only one"),
    (["reward.reward_manager.name=prime"],
     "reward.reward_manager.name: unknown value 'prime'; expected one of: naive, dapo"),
])
def test_reward_group_errors_name_the_key(overrides, line):
    assert refused(overrides) == line


def test_alias_defaults_match_the_yaml():
    """An alias copies a set src; dst_default is what the YAML holds, else a user value would pass as unset."""
    for name in (FSDP, MEGATRON):
        cfg = OmegaConf.create(OmegaConf.to_container(compose(name), resolve=True))  # before validation fills "auto"
        for alias in ALIASES:
            src, dst = OmegaConf.select(cfg, alias.src), OmegaConf.select(cfg, alias.dst)
            assert src is None or unset(OmegaConf.to_container(src)), alias
            assert (OmegaConf.to_container(dst) if OmegaConf.is_config(dst) else dst) == alias.dst_default, alias


# --------------------------------------------------------------------------- FSDP strategy
def test_fsdp_config_strategy(caplog):
    reset_compat_warnings()
    with caplog.at_level(logging.WARNING, logger="verl_async.config"):
        cfg = check(["actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2"])
    assert caplog.records == []  # verl 0.9: the FSDP family, FSDP2 engine
    assert cfg.actor_rollout_ref.actor.strategy == cfg.actor_rollout_ref.ref.strategy == "fsdp2"
    assert cfg.actor_rollout_ref.ref.fsdp_config.strategy == "fsdp2"
    with caplog.at_level(logging.WARNING, logger="verl_async.config"):
        check(["actor_rollout_ref.actor.fsdp_config.strategy=fsdp"])
    assert [r.getMessage() for r in caplog.records] == [
        "actor_rollout_ref.actor.fsdp_config.strategy=fsdp runs as fsdp2 (FSDP1 is not supported)"]
    assert refused(["actor_rollout_ref.actor.fsdp_config.strategy=fsdp2"], MEGATRON) == (
        "actor_rollout_ref.actor.fsdp_config.strategy: fsdp2: an FSDP setting, but "
        "actor_rollout_ref.actor.strategy=megatron; remove it")


# --------------------------------------------------------------------------- rollout correction
def _rc(**kw):
    base = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs=None,
                rollout_rs_threshold=None, bypass_mode=None, loss_type="ppo_clip")
    return OmegaConf.create({**base, **kw})


def test_parse_bounds():
    assert parse_bounds("k", 2.0) == (None, 2.0) and parse_bounds("k", "3") == (None, 3.0)
    assert parse_bounds("k", "0.5_5.0") == (0.5, 5.0)
    for bad, words in (("5_0.5", "lower bound 5 > upper bound 0.5"), ("x", "expected a number"), (0, "positive")):
        with pytest.raises(ConfigError, match=words):
            parse_bounds("k", bad)


def test_rollout_correction_translation():
    assert rollout_correction_from_verl(_rc()) is None
    assert rollout_correction_from_verl(_rc(rollout_is="sequence", rollout_is_threshold=3.0,
                                            rollout_is_batch_normalize=True)) == {
        "enable": True, "level": "sequence", "mode": "truncate", "lower": None, "upper": 3.0, "batch_normalize": True}
    icepop = rollout_correction_from_verl(_rc(rollout_is="token", rollout_is_threshold="0.5_5.0"))
    assert (icepop["mode"], icepop["lower"], icepop["upper"]) == ("mask", 0.5, 5.0)
    # one number u for a k1 option is [1/u, u] on pi_rollout / pi_old, i.e. [1/u, u] on r as well
    rs = rollout_correction_from_verl(_rc(rollout_is="token", rollout_rs="seq_sum_k1", rollout_rs_threshold=2.0))
    assert (rs["rs"], rs["rs_level"], rs["rs_lower"], rs["rs_upper"]) == (True, "sequence", 0.5, 2.0)
    rs = rollout_correction_from_verl(_rc(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"))
    assert (rs["rs_level"], rs["rs_lower"], rs["rs_upper"]) == ("token", 0.8, 1.25)


def test_seq_mean_k1_rejects_what_verl_rejects():
    """verl keeps a sequence when -mean(log r) lies in [log 0.99, log 1.001] (hand-computed below)."""
    out = rollout_correction_from_verl(_rc(rollout_is="token", rollout_rs="seq_mean_k1",
                                           rollout_rs_threshold="0.99_1.001"))
    kwargs = {k: v for k, v in out.items() if k != "enable"}
    rollout = torch.zeros(3, 2)
    # log r per token: A +0.001 (k1 -0.001: kept), B -0.002 (k1 0.002 > log 1.001 = 0.0009995: rejected),
    # C +0.02 (k1 -0.02 < log 0.99 = -0.01005: rejected)
    old = torch.tensor([[0.001, 0.001], [-0.002, -0.002], [0.02, 0.02]])
    _, mask, _ = rollout_correction(old, rollout, torch.ones(3, 2), **kwargs)
    assert mask.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]


@pytest.mark.parametrize("kw,line", [
    (dict(rollout_rs="token_k1", rollout_rs_threshold=2.0),
     f"{RC}.rollout_rs: rejection without importance weights (rollout_is=null) is not implemented; set "
     f"{RC}.rollout_is=token or sequence"),
    (dict(rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
     f"{RC}.rollout_rs: 'seq_mean_k3' not implemented; verl_async rejects on one ratio bound: token_k1, seq_sum_k1, "
     "seq_mean_k1"),
    (dict(rollout_is="token", rollout_rs="token_k1,seq_mean_k1", rollout_rs_threshold=2.0),
     f"{RC}.rollout_rs: several options not implemented; verl_async rejects on one ratio bound: token_k1, "
     "seq_sum_k1, seq_mean_k1"),
    (dict(rollout_is="token", rollout_rs="token_k1"),
     f"{RC}.rollout_rs_threshold: must be set when rollout_rs=token_k1 (as in verl)"),
])
def test_rollout_correction_refusals(kw, line):
    """Decoupled mode (bypass_mode=false): what verl_async's own correction cannot express."""
    with pytest.raises(ConfigError) as err:
        rollout_correction_from_verl(_rc(**kw))
    assert str(err.value) == line


def test_rollout_correction_in_the_config():
    cfg = check([f"{RC}.bypass_mode=false", f"{RC}.rollout_is=token"])
    rc = cfg.actor_rollout_ref.actor.rollout_correction
    assert cfg.async_training.use_rollout_log_probs is False and (rc.enable, rc.level, rc.upper) == (True, "token", 2.0)
    assert refused([f"{RC}.bypass_mode=true", "async_training.use_rollout_log_probs=false"]) == (
        f"{RC}.bypass_mode: True conflicts with async_training.use_rollout_log_probs=False; set only one")
    both = [f"{RC}.bypass_mode=false", f"{RC}.rollout_is=token", "actor_rollout_ref.actor.rollout_correction.enable=true"]
    assert refused(both).startswith(f"{RC}.rollout_is: verl 0.9's algorithm.rollout_correction and ")


# --------------------------------------------------------------------------- bypass mode: verl's bypass_mode loss
PL = "actor_rollout_ref.actor.policy_loss"


def test_bypass_mode_with_a_correction_trains_with_the_bypass_mode_loss(caplog):
    """verl's apply_bypass_mode: algorithm.rollout_correction -> policy_loss.rollout_correction, loss_mode=bypass_mode
    (verl 0.9.1 applies it too late for its workers, verl-project/verl#4912; verl_async does what verl documents)."""
    cfg = check([f"{RC}.rollout_is=token", f"{RC}.rollout_rs='seq_mean_k3,token_k1'",
                 f"{RC}.rollout_rs_threshold='0.01,0.5_2.0'", f"{RC}.loss_type=reinforce"])
    pl = cfg.actor_rollout_ref.actor.policy_loss
    assert pl.loss_mode == "bypass_mode" and cfg.async_training.use_rollout_log_probs is True
    assert OmegaConf.to_container(pl.rollout_correction) == {
        "rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
        "rollout_rs": "seq_mean_k3,token_k1", "rollout_rs_threshold": "0.01,0.5_2.0", "loss_type": "reinforce"}
    assert cfg.actor_rollout_ref.actor.rollout_correction.enable is False  # not the decoupled correction
    # without a correction, bypass mode keeps the loss the run names (bypass_mode's ppo_clip is vanilla there)
    assert check([f"{PL}.loss_mode=gspo"]).actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"
    # decoupled mode: loss_type only picks bypass mode's loss (verl ignores it there)
    reset_compat_warnings()
    with caplog.at_level(logging.WARNING, logger="verl_async.config"):
        check([f"{RC}.bypass_mode=false", f"{RC}.loss_type=reinforce"])
    assert [r.getMessage() for r in caplog.records] == [
        f"{RC}.loss_type=reinforce has no effect with bypass_mode=false (as in verl: it picks bypass mode's loss)"]


@pytest.mark.parametrize("overrides,line", [
    ([f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=2.0", f"{PL}.loss_mode=gspo"],
     f"{PL}.loss_mode: gspo: {RC}.rollout_rs with bypass_mode=true trains with verl's bypass_mode loss (PPO clip or "
     "REINFORCE against the rollout policy); use loss_mode=vanilla, or bypass_mode=false to keep gspo"),
    ([f"{RC}.rollout_rs=token_k5", f"{RC}.rollout_rs_threshold=2.0"],
     f"{PL}.rollout_correction.rollout_rs: unknown option 'token_k5'; expected one of: token_k1, token_k2, token_k3, "
     "seq_sum_k1, seq_sum_k2, seq_sum_k3, seq_mean_k1, seq_mean_k2, seq_mean_k3, seq_max_k2, seq_max_k3"),
    ([f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold='0.5_2'"],
     f"{PL}.rollout_correction.rollout_rs_threshold: token_k2 takes one upper bound, got '0.5_2'"),
    ([f"{RC}.rollout_rs=token_k1"],
     f"{PL}.rollout_correction.rollout_rs_threshold: must be set when rollout_rs=token_k1"),
    ([f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_batch_normalize=true", f"{RC}.loss_type=reinforce"],
     f"{PL}.rollout_correction.rollout_is_batch_normalize: true with loss_type=reinforce in bypass mode is not "
     "implemented (verl normalises each micro-batch's weights over all ranks inside the loss); set it to false"),
    ([f"{RC}.rollout_is=token", f"{PL}.rollout_correction.rollout_is=sequence"],
     f"{RC}.rollout_is: 'token' conflicts with {PL}.rollout_correction.rollout_is='sequence'; set only one"),
    ([f"{PL}.loss_mode=bypass_mode", f"{RC}.bypass_mode=false"],
     f"{PL}.loss_mode: bypass_mode takes the rollout's log-probs as the old policy, but "
     f"{RC}.bypass_mode=false (async_training.use_rollout_log_probs=false) recomputes them; set bypass_mode=true or "
     "another loss_mode"),
    ([f"{PL}.loss_mode=dro"], f"{PL}.dro_beta: must be set (> 0) for policy_loss.loss_mode=dro"),
])
def test_policy_loss_refusals(overrides, line):
    assert refused(overrides) == line


def test_every_verl_loss_mode_is_accepted():
    from verl_async.config.schema_rules import POLICY_LOSS_MODES

    for mode in POLICY_LOSS_MODES:
        extra = [f"{PL}.dro_beta=0.1"] if mode == "dro" else []
        assert check([f"{PL}.loss_mode={mode}", "actor_rollout_ref.actor.tau_pos=1.2", *extra]
                     ).actor_rollout_ref.actor.policy_loss.loss_mode == mode


# --------------------------------------------------------------------------- checkpoint engine
def test_checkpoint_engine_keys():
    cfg = check(["actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1024",
                 "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "trainer.device=cuda"])
    at = cfg.async_training
    assert (at.sync_bucket_size_mb, at.checkpoint_engine.device_buffer_size_M, at.sync_transport) == (1024, 1024, "nccl")
    assert refused(["actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1024",
                    "async_training.sync_bucket_size_mb=512"]) == (
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes: 1024 conflicts with "
        "async_training.sync_bucket_size_mb=512; set only one")
    assert refused(["actor_rollout_ref.rollout.checkpoint_engine.backend=nixl"]) == (
        "actor_rollout_ref.rollout.checkpoint_engine.backend: unknown value 'nixl'; expected one of: nccl, hccl")


# --------------------------------------------------------------------------- refusals, warnings
_VLM = "vision-language (multi-modal) training is not implemented in verl_async; train a text-only model"


@pytest.mark.parametrize("overrides,name,line", [
    (["+data.image_key=images"], FSDP, f"data.image_key: 'images': {_VLM}"),
    (["+actor_rollout_ref.actor.freeze_vision_tower=true"], FSDP, f"actor_rollout_ref.actor.freeze_vision_tower: True: {_VLM}"),
    (["+actor_rollout_ref.rollout.expert_parallel_size=8"], FSDP,
     "actor_rollout_ref.rollout.expert_parallel_size: 8: expert-parallel MoE generation is not implemented in "
     "verl_async (dense models); leave it at 1"),
    (["+actor_rollout_ref.model.lora.rank=8", "+actor_rollout_ref.model.lora.alpha=16"], FSDP,
     "actor_rollout_ref.model.lora.rank: 8: verl's Megatron LoRA (model.lora.*) is not implemented in verl_async; LoRA "
     "trains with the FSDP2 trainer: set actor_rollout_ref.model.lora_rank (and lora_alpha, target_modules) instead"),
    (["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2", "trainer.n_gpus_per_node=2"], MEGATRON,
     "actor_rollout_ref.actor.megatron.expert_model_parallel_size: 2: MoE expert parallelism is not implemented (the "
     "Megatron trainer converts dense models); set it to 1"),
    # a reward model is built now (verl_async/reward_models/, docs/verl_v1.md): enabled without one, one line
    (["reward.reward_model.enable=true"], FSDP, "reward.reward_model.model_path: required with reward.reward_model."
     "enable=true (an HF folder or id: *ForSequenceClassification to score, or an instruct model as judge)"),
    (["reward.reward_manager.source=importlib"], FSDP, "reward.reward_manager.source: importlib (a custom reward "
     "manager class) is not supported; use reward.reward_manager.name=naive|dapo with a reward.custom_reward_function"),
    (["actor_rollout_ref.rollout.name=trtllm"], FSDP, "actor_rollout_ref.rollout.name: trtllm: TensorRT-LLM "
     "generation is not implemented; use one of: native, vllm"),
])
def test_unimplemented_features_are_refused_in_one_line(overrides, name, line):
    assert refused(overrides, name) == line


def test_neutral_values_pass():
    cfg = check(["+actor_rollout_ref.rollout.expert_parallel_size=1", "+actor_rollout_ref.model.lora.rank=0",
                 "reward.reward_model.enable=false", "actor_rollout_ref.rollout.multi_turn.enable=false",
                 "reward.sandbox_fusion.url=http://localhost:8080/run_code"])  # code rewards: accepted (issue 36)
    assert cfg.reward.sandbox_fusion.url == "http://localhost:8080/run_code"
    assert "expert_parallel_size" not in cfg.actor_rollout_ref.rollout and "lora" not in cfg.actor_rollout_ref.model


def test_unused_verl_keys_are_named(caplog):
    reset_compat_warnings()
    overrides = ["actor_rollout_ref.actor.fsdp_config.fsdp_size=2", "data.gen_batch_size=4",
                 "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=3", "+reward.reward_model.model_path=/m"]
    with caplog.at_level(logging.WARNING, logger="verl_async.config"):
        check(overrides)
    named = sorted(r.getMessage().split("=")[0] for r in caplog.records)
    assert named == ["actor_rollout_ref.actor.fsdp_config.fsdp_size",
                     "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts",
                     "data.gen_batch_size", "reward.reward_model.model_path"]


def test_preflight_refuses_a_vision_language_model(tmp_path):
    from verl_async.config.preflight import check_model_folder

    (tmp_path / "config.json").write_text('{"model_type": "qwen2_5_vl", "vision_config": {"depth": 32}}')
    cfg = OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(tmp_path)}}})
    with pytest.raises(ConfigError) as err:
        check_model_folder(cfg)
    assert str(err.value) == (f"actor_rollout_ref.model.path: {tmp_path} is a vision-language model (config.json has "
                              "vision_config); VLM training is not implemented in verl_async: use a text-only model")
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    check_model_folder(cfg)


@pytest.mark.parametrize("config,said", [
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}, "model_type 'qwen3_moe', num_experts 8"),
    ({"model_type": "mixtral", "num_local_experts": 8}, "model_type 'mixtral', num_local_experts 8"),
    ({"model_type": "deepseek_v3", "n_routed_experts": 256}, "model_type 'deepseek_v3', n_routed_experts 256"),
])
def test_preflight_refuses_a_mixture_of_experts_model(tmp_path, config, said):
    """A tiny Qwen3-MoE passed the dry run and trained, on code paths built and tested for dense models only,
    though the README said MoE is refused (issue 42)."""
    import json

    from verl_async.config.preflight import check_model_folder

    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(tmp_path)}}})
    with pytest.raises(ConfigError) as err:
        check_model_folder(cfg)
    assert str(err.value) == (f"actor_rollout_ref.model.path: {tmp_path} is a mixture-of-experts model ({said} in its "
                              "config.json); verl_async trains dense models only (Qwen2, Qwen3, Llama, Mistral and "
                              "their kind): use a dense model")
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "num_experts": 1}')  # one expert is a dense model
    check_model_folder(cfg)


# --------------------------------------------------------------------------- Ray, Megatron and rollout keys of verl 0.9
def test_ray_runtime_env_is_merged_as_verl_merges_it(tmp_path):
    """ray_kwargs.ray_init.runtime_env onto verl_async's env_vars: the run's keys win, PYTHONPATH is appended."""
    from verl_async.pipeline import ray_runtime_env

    cfg = check(["+ray_kwargs.ray_init.runtime_env.env_vars.NCCL_DEBUG=INFO",
                 "+ray_kwargs.ray_init.runtime_env.env_vars.TOKENIZERS_PARALLELISM=yes",
                 "+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH=/extra",
                 f"+ray_kwargs.ray_init.runtime_env.working_dir={tmp_path}"])
    env = ray_runtime_env(cfg)
    assert env["working_dir"] == str(tmp_path) and "py_executable" not in env  # null: Ray's default
    assert env["env_vars"]["NCCL_DEBUG"] == "INFO" and env["env_vars"]["TOKENIZERS_PARALLELISM"] == "yes"
    assert env["env_vars"]["PYTHONPATH"].endswith(os.pathsep + "/extra")
    assert env["env_vars"]["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)  # workers still import verl_async
    assert ray_runtime_env(check([]))["env_vars"]["TOKENIZERS_PARALLELISM"] == "false"
    # verl's examples set the interpreter of every worker; a command that is not there is refused
    assert check(["ray_kwargs.ray_init.runtime_env.py_executable=null"]).ray_init.runtime_env.py_executable is None
    assert ray_runtime_env(check([f"ray_kwargs.ray_init.runtime_env.py_executable={sys.executable}"]))[
        "py_executable"] == sys.executable
    assert refused(["ray_kwargs.ray_init.runtime_env.py_executable='uvx-nope -v run --frozen'"]) == (
        "ray_kwargs.ray_init.runtime_env.py_executable: 'uvx-nope -v run --frozen': uvx-nope is not an executable on "
        "PATH (Ray starts every worker with it); set it to null for this Python")


def test_verl09_megatron_and_rollout_keys_are_accepted(caplog):
    reset_compat_warnings()
    with caplog.at_level(logging.WARNING, logger="verl_async.config"):
        cfg = check(["actor_rollout_ref.actor.megatron.use_remove_padding=False",
                     "actor_rollout_ref.actor.megatron.vanilla_mbridge=True",
                     "+actor_rollout_ref.rollout.enable_sleep_mode=False",
                     "+actor_rollout_ref.model.mtp.enable=False", "+actor_rollout_ref.model.mtp.method=mtp"], MEGATRON)
    assert cfg.actor_rollout_ref.ref.megatron.vanilla_mbridge is True and "mtp" not in cfg.actor_rollout_ref.model
    assert sorted(r.getMessage().split("=")[0] for r in caplog.records) == [
        "actor_rollout_ref.actor.megatron.use_remove_padding", "actor_rollout_ref.actor.megatron.vanilla_mbridge"]


@pytest.mark.parametrize("overrides,name,line", [
    (["+actor_rollout_ref.model.mtp.enable=True", "+actor_rollout_ref.model.mtp.speculative_num_steps=3"], FSDP,
     "actor_rollout_ref.model.mtp.enable: True: multi-token prediction (MTP: an extra head trained and used for "
     "speculative decoding) is not implemented in verl_async; set mtp.enable, enable_train and enable_rollout to "
     "false"),
    # a MoE script hears that first, before any key of it that is unknown here
    (["actor_rollout_ref.actor.megatron.expert_model_parallel_size=8", "+actor_rollout_ref.actor.megatron.nope=1"],
     MEGATRON, "actor_rollout_ref.actor.megatron.expert_model_parallel_size: 8: MoE expert parallelism is not "
               "implemented (the Megatron trainer converts dense models); set it to 1"),
])
def test_verl09_features_refused_first_in_one_line(overrides, name, line):
    assert refused(overrides, name) == line


# --------------------------------------------------------------------------- LoRA (verl's FSDP keys)
def test_lora_keys_are_accepted_with_verls_meaning(tmp_path, caplog):
    M = "actor_rollout_ref.model"
    reset_compat_warnings()
    with caplog.at_level(logging.WARNING, logger="verl_async.config"):
        cfg = check([f"{M}.lora_rank=64", f"{M}.lora_alpha=32", f"{M}.target_modules=[q_proj,v_proj]",
                     "actor_rollout_ref.rollout.layered_summon=True", "actor_rollout_ref.rollout.load_format=safetensors"])
    assert (cfg[M.split(".")[0]].model.lora_rank, cfg.actor_rollout_ref.model.lora_alpha) == (64, 32.0)
    assert list(cfg.actor_rollout_ref.model.target_modules) == ["q_proj", "v_proj"]
    assert [r.getMessage().split("=")[0] for r in caplog.records] == ["actor_rollout_ref.rollout.layered_summon"]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    assert refused([f"{M}.lora_rank=8", f"{M}.lora_adapter_path={adapter}"]) == (
        f"{M}.lora_adapter_path: {adapter}: no adapter_config.json there (a peft adapter folder, e.g. a checkpoint's "
        "actor/huggingface/lora_adapter)")
    (adapter / "adapter_config.json").write_text("{}")
    assert check([f"{M}.lora_rank=8", f"{M}.lora_adapter_path={adapter}"]).actor_rollout_ref.model.lora_adapter_path
    assert refused([f"{M}.lora_adapter_path={adapter}"]) == (
        f"{M}.lora_adapter_path: {adapter}: a LoRA adapter needs {M}.lora_rank > 0 (its rank)")
    assert refused([f"{M}.lora_rank=8", "trainer.n_gpus_per_node=1"], MEGATRON) == (
        f"{M}.lora_rank: 8: LoRA is not implemented in the Megatron trainer; use actor_rollout_ref.actor.strategy=fsdp2 "
        "(the default config)")
