"""`distillation.*` read and checked (config/distillation.py): verl's rules and messages, verl_async's placement."""

from __future__ import annotations

import pytest

from verl_async.config import ConfigError, compose, validate
from verl_async.config.distillation import distillation_spec

ON = ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/m/teacher"]
TWO = ["distillation.enabled=true", "+distillation.teacher_models.a.key=openai/gsm8k",
       "+distillation.teacher_models.a.model_path=/m/a", "+distillation.teacher_models.a.num_replicas=1",
       "+distillation.teacher_models.b.key=geo", "+distillation.teacher_models.b.model_path=/m/b",
       "+distillation.teacher_models.b.num_replicas=2"]


def spec(overrides):
    return distillation_spec(validate(compose("fully_async_ppo_trainer", overrides)))


def refused(overrides, name="fully_async_ppo_trainer"):
    with pytest.raises(ConfigError) as err:
        validate(compose(name, overrides))
    return str(err.value)


def test_single_teacher_routes_every_row_and_sits_beside_the_engines():
    s = spec(ON)
    assert [(t.name, t.key, t.model_path, t.num_replicas) for t in s.teachers] == [
        ("teacher_model", "default", "/m/teacher", 1)]
    assert s.route("anything") == "default" and s.route(None) == "default" and s.nnodes == 0
    assert (s.loss.loss_mode, s.loss.topk, s.loss.use_task_rewards) == ("k3", 32, True)  # verl's YAML defaults
    assert spec([]) is None


def test_named_teachers_drop_the_default_one_and_fill_a_pool():
    s = spec(TWO + ["distillation.nnodes=1", "distillation.n_gpus_per_node=3"])
    assert sorted((t.key, t.num_replicas) for t in s.teachers) == [("geo", 2), ("openai/gsm8k", 1)]
    assert s.route("geo") == "geo"
    with pytest.raises(ValueError, match="No teacher configured for routing key 'math'"):
        s.route("math")
    with pytest.raises(ValueError, match="Routing key is required"):
        s.route(None)
    single = spec(ON + ["distillation.nnodes=1", "distillation.n_gpus_per_node=4"])
    assert single.teachers[0].num_replicas == 4  # verl: the single teacher takes the whole pool


@pytest.mark.parametrize("extra, message", [
    (["distillation.distillation_loss.loss_mode=k1"],
     "distillation.distillation_loss.loss_mode: Directly backpropagating k1 loss is incorrect since gradient of k1 "
     "loss wrt model weights does not depend on teacher log probabilities."),
    (["distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=null"],
     "distillation.distillation_loss.topk: topk must be specified when use_topk is True."),
    (["distillation.distillation_loss.loss_mode=reverse_kl"],
     "distillation.distillation_loss.loss_mode: unknown value 'reverse_kl'; expected one of: kl, k1, abs, mse, k2, "
     "low_var_kl, k3, forward_kl_topk"),
    (["distillation.teacher_models.teacher_model.model_path=null"],
     "distillation.teacher_models.teacher_model.model_path: model_path must be specified for distillation teacher "
     "model config."),
    (["distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2"],
     "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size: 2: a teacher replica runs on "
     "one device here (an HF forward pass); set it to 1 and raise num_replicas"),
    (["+distillation.teacher_models.teacher_model.inference.colour=red"],
     "distillation.teacher_models.teacher_model.inference.colour: unknown key (verl's RolloutConfig keys)"),
    (["distillation.teacher_models.teacher_model.inference.max_model_len=100", "data.max_prompt_length=64",
      "data.max_response_length=64"],
     "distillation.teacher_models.teacher_model.inference.max_model_len: Distillation teacher inference requires room "
     "for the student prompt, the full student response, and one generated token, but got student_prompt_length=64, "
     "student_response_length=64, required_context_len=129, max_model_len=100."),
    (["distillation.nnodes=1", "distillation.n_gpus_per_node=2", "distillation.teacher_models.teacher_model."
      "num_replicas=1"],
     "distillation.nnodes: Sum of teacher (num_replicas * per_replica_world_size) (1) must match the distillation "
     "resource pool size (self.n_gpus_per_node=2 * self.nnodes=1 = 2)."),
    (["trainer.device=cuda"],
     "distillation.nnodes: 0 puts the teachers; a teacher beside the engine replicas needs rollout.colocate=true on an "
     "accelerator (the devices the engines share with the trainer); with separate engine devices give it devices of "
     "its own"),
])
def test_verls_rules_and_ours_are_one_line(extra, message):
    assert refused(ON + extra) == message


def test_duplicate_keys_and_a_teacher_without_key():
    assert refused(TWO + ["distillation.teacher_models.b.key=openai/gsm8k"]) == (
        "distillation.teacher_models: Duplicate teacher key openai/gsm8k found in teacher models.")
    assert refused(TWO + ["~distillation.teacher_models.b.key"]) == (
        "distillation.teacher_models.b.key: key must be specified for distillation teacher model config.")


def test_topk_needs_the_fsdp_trainer():
    assert refused(ON + ["distillation.distillation_loss.loss_mode=forward_kl_topk", "actor_rollout_ref.actor."
                         "strategy=megatron"], "fully_async_ppo_megatron_trainer").startswith(
        "distillation.distillation_loss.loss_mode: forward_kl_topk needs the student's logits")


def test_keys_of_a_disabled_distillation_are_named(caplog):
    import logging

    from verl_async.config import reset_compat_warnings

    reset_compat_warnings()
    with caplog.at_level(logging.WARNING, logger="verl_async.config"):
        validate(compose("fully_async_ppo_trainer", ["distillation.teacher_key=task"]))
    assert "distillation.teacher_key='task' has no effect with distillation.enabled=false" in caplog.text


def test_the_dry_run_looks_at_the_teachers_folders(tmp_path, tiny_model_dir):
    from verl_async.config.distillation import preflight_side_models

    class Tok:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    cfg = validate(compose("fully_async_ppo_trainer", ["distillation.enabled=true",
                                                       f"distillation.teacher_models.teacher_model.model_path={tmp_path}"]))
    with pytest.raises(ConfigError, match="no model folder there"):
        preflight_side_models(cfg, Tok(10))
    cfg.distillation.teacher_models.teacher_model.model_path = tiny_model_dir
    preflight_side_models(cfg, Tok(100))
    with pytest.raises(ConfigError, match="fewer than the student's 100000; a teacher must share the student's"):
        preflight_side_models(cfg, Tok(100000))
    cfg.distillation.enabled = False
    cfg.reward.reward_model.enable = True
    cfg.reward.reward_model.model_path = tiny_model_dir
    preflight_side_models(cfg, Tok(100000))  # a causal LM: a judge
