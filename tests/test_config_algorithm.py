"""Config rules of the algorithm keys: nothing accepted may be silently without effect (issue 13)."""

from __future__ import annotations

import pytest

from verl_async.config import ConfigError, compose, validate

FSDP, MEGATRON = "fully_async_ppo_trainer", "fully_async_ppo_megatron_trainer"
RC = "actor_rollout_ref.actor.rollout_correction"


def check(overrides, name=FSDP):
    return validate(compose(name, overrides))


# --------------------------------------------------------------------------- rollout correction (item 8)
@pytest.mark.parametrize("name", [FSDP, MEGATRON])
def test_rollout_correction_in_bypass_mode_is_refused_naming_both_keys(name):
    with pytest.raises(ConfigError) as info:
        check([f"{RC}.enable=true"], name)  # default: async_training.use_rollout_log_probs=true
    assert info.value.key == f"{RC}.enable"
    assert "async_training.use_rollout_log_probs" in info.value.reason
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("recompute", ["async_training.use_rollout_log_probs=false",
                                       "async_training.compute_prox_log_prob=true"])
def test_rollout_correction_with_recomputed_old_log_probs_is_valid(recompute):
    # the GPU scripts' combination (scripts/device/real_model_gpu.sh)
    cfg = check([recompute, f"{RC}.enable=true", f"{RC}.veto_threshold=1e-6"])
    assert cfg.actor_rollout_ref.actor.rollout_correction.enable is True


def test_actor_use_rollout_log_probs_follows_async_training():
    assert check(["async_training.use_rollout_log_probs=false"]).actor_rollout_ref.actor.use_rollout_log_probs is False
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.use_rollout_log_probs: .*async_training"):
        check(["actor_rollout_ref.actor.use_rollout_log_probs=false"])


# --------------------------------------------------------------------------- veto (item 9)
def test_veto_rule_choices_and_threshold_bounds():
    assert check([])["actor_rollout_ref"]["actor"]["rollout_correction"]["veto_rule"] == "old_prob"
    assert check([f"{RC}.veto_rule=ratio"]).actor_rollout_ref.actor.rollout_correction.veto_rule == "ratio"
    with pytest.raises(ConfigError, match=rf"^{RC}\.veto_rule: unknown value 'prob'"):
        check([f"{RC}.veto_rule=prob"])
    with pytest.raises(ConfigError, match=rf"^{RC}\.veto_threshold: must be > 0"):
        check([f"{RC}.veto_threshold=0"])


# --------------------------------------------------------------------------- accepted keys have an effect (item 11)
def test_adaptive_kl_control_needs_the_in_reward_kl():
    with pytest.raises(ConfigError, match=r"^algorithm\.kl_ctrl\.type: adaptive .*algorithm\.use_kl_in_reward"):
        check(["algorithm.kl_ctrl.type=adaptive"])
    cfg = check(["algorithm.kl_ctrl.type=adaptive", "algorithm.use_kl_in_reward=true",
                 "algorithm.kl_ctrl.target_kl=0.05", "algorithm.kl_ctrl.horizon=500"])
    assert cfg.algorithm.kl_ctrl.type == "adaptive"


def test_ulysses_sequence_parallelism_keys():
    """FSDP2 runs Ulysses (trainer/ulysses.py): the data-parallel size is world / sp; Megatron uses context
    parallelism instead; the reference model follows the actor's layout; packed rows and a varlen kernel."""
    A = "actor_rollout_ref"
    cfg = check(["trainer.n_gpus_per_node=4", f"{A}.actor.ulysses_sequence_parallel_size=2",
                 f"{A}.ref.ulysses_sequence_parallel_size=2"])
    assert cfg[A].actor.ulysses_sequence_parallel_size == 2
    assert cfg[A].ref.ulysses_sequence_parallel_size == 2  # dp_actor.yaml's ref follows the actor by default
    # a micro-batch holds sp x the per-device budget: 3000 tokens per device hold a 4096-token sequence with sp = 2
    long = ["data.max_prompt_length=1024", "data.max_response_length=3072", f"{A}.actor.ppo_max_token_len_per_gpu=3000",
            f"{A}.rollout.log_prob_max_token_len_per_gpu=3000", f"{A}.ref.log_prob_max_token_len_per_gpu=3000"]
    from verl_async.config.checks import token_budget_problem

    assert token_budget_problem(check(["trainer.n_gpus_per_node=2", f"{A}.actor.ulysses_sequence_parallel_size=2",
                                       *long])) is None
    with pytest.raises(ConfigError) as too_small:
        check(long)
    assert str(too_small.value) == (
        f"{A}.actor.ppo_max_token_len_per_gpu: 3000 tokens per update micro-batch cannot hold one sequence of up to "
        "data.max_prompt_length + data.max_response_length = 1024 + 3072 = 4096 tokens (dynamic batch size packs whole "
        "sequences); raise it to at least 4096 or shorten those lengths")
    refusals = [
        ([f"{A}.actor.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2"], MEGATRON,
         f"{A}.actor.ulysses_sequence_parallel_size: 2: Ulysses is the FSDP2 trainer's; Megatron splits sequences "
         f"with {A}.actor.megatron.context_parallel_size"),
        ([f"{A}.ref.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2"], FSDP,
         f"{A}.ref.ulysses_sequence_parallel_size: 2: the reference model runs on the actor's ranks with its "
         f"layout; set it to 1 (actor_rollout_ref.actor.ulysses_sequence_parallel_size)"),
        ([f"{A}.actor.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2",
          f"{A}.model.use_remove_padding=false"], FSDP,
         f"{A}.actor.ulysses_sequence_parallel_size: 2 needs packed rows: set {A}.model.use_remove_padding=true "
         "(as verl does)"),
        ([f"{A}.actor.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2",
          f"{A}.model.attn_implementation=sdpa"], FSDP,
         f"{A}.actor.ulysses_sequence_parallel_size: 2 needs a varlen attention kernel; {A}.model.attn_implementation="
         "sdpa has none (use auto, varlen or flash_attention_2)"),
        ([f"{A}.actor.ulysses_sequence_parallel_size=3", "trainer.n_gpus_per_node=2"], FSDP,
         f"{A}.actor.ulysses_sequence_parallel_size: ulysses sequence parallel size 3 does not divide the trainer's 2 "
         "devices (trainer.nnodes * trainer.n_gpus_per_node)"),
    ]
    for overrides, name, line in refusals:
        with pytest.raises(ConfigError) as info:
            check(overrides, name)
        assert str(info.value) == line


# --------------------------------------------------------------------------- DAPO dynamic sampling (issue 24)
FG = "algorithm.filter_groups"


@pytest.mark.parametrize("name", [FSDP, MEGATRON])
def test_filter_groups_takes_verl_keys(name):
    cfg = check([f"{FG}.enable=true", f"{FG}.metric=acc", f"{FG}.max_num_gen_batches=10"], name)
    assert (cfg.algorithm.filter_groups.metric, cfg.algorithm.filter_groups.max_num_gen_batches) == ("acc", 10)
    assert check([], name).algorithm.filter_groups.enable is False


@pytest.mark.parametrize("overrides, key, reason", [
    ([f"{FG}.enable=true"], f"{FG}.metric", "required with filter_groups.enable=true"),
    ([f"{FG}.enable=true", f"{FG}.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"], f"{FG}.metric",
     "seq_final_reward subtracts the in-reward KL"),
    ([f"{FG}.enable=true", f"{FG}.metric=acc", "actor_rollout_ref.rollout.n=1",
      "algorithm.adv_estimator=reinforce_plus_plus"], f"{FG}.enable", "group of one response"),
    ([f"{FG}.enable=true", f"{FG}.metric=acc", "debug.train_only=true"], f"{FG}.enable", "debug.train_only"),
    ([f"{FG}.max_num_gen_batches=-1"], f"{FG}.max_num_gen_batches", "must be >= 0"),
])
def test_filter_groups_errors_name_the_key(overrides, key, reason):
    with pytest.raises(ConfigError) as info:
        check(overrides)
    assert info.value.key == key and reason in info.value.reason


# --------------------------------------------------------------------------- checkpoint contents (issue 24)
CK = "actor_rollout_ref.actor.checkpoint"


@pytest.mark.parametrize("name", [FSDP, MEGATRON])
def test_hf_model_in_save_contents_is_verls_switch(name):
    from omegaconf import OmegaConf

    from verl_async.trainer.settings import TrainerSettings

    cfg = check([f"{CK}.save_contents=[model,optimizer,extra,hf_model]"], name)
    assert "hf_model" in cfg.actor_rollout_ref.actor.checkpoint.load_contents  # follows save_contents, as in verl
    assert TrainerSettings.from_config(OmegaConf.to_container(cfg, resolve=True)).save_hf_model is True
    assert TrainerSettings.from_config(OmegaConf.to_container(check([], name), resolve=True)).save_hf_model is False


@pytest.mark.parametrize("overrides, key, reason", [
    ([f"{CK}.save_contents=[hf_model]"], f"{CK}.save_contents", "missing model, optimizer, extra"),
    ([f"{CK}.load_contents=[model,extra]"], f"{CK}.load_contents", "missing optimizer"),
    ([f"{CK}.save_contents=[model,optimizer,extra,weights]"], f"{CK}.save_contents", "unknown value 'weights'"),
])
def test_checkpoint_contents_that_would_be_ignored_are_refused(overrides, key, reason):
    with pytest.raises(ConfigError) as info:
        check(overrides)
    assert info.value.key == key and reason in info.value.reason
