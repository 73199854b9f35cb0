"""verl's V1 trainer keys (config/verl_v1.py) onto verl_async's: hand values, verl's rules, conflicts, refusals;
the V1 off-policy accounting (verl_async/off_policy.py) and the oldest-first queue order it needs."""

from __future__ import annotations

import asyncio
import logging

import pytest
from omegaconf import OmegaConf

from verl_async.config import ConfigError, compose, max_required_samples, reset_compat_warnings, validate
from verl_async.config.verl_v1 import OURS_DEFAULTS, V1_DEFAULTS, off_policy_wait, oldest_first
from verl_async.off_policy import must_wait, span, trajectory_metrics
from verl_async.protocol import Response, RolloutSample
from verl_async.queue import MessageQueue

V1 = ["trainer.use_v1=true"]
SEPARATE = V1 + ["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "trainer.v1.separate_async.parameter_sync_step=4", "data.train_batch_size=8"]


def v(overrides, name="fully_async_ppo_trainer"):
    return validate(compose(name, overrides))


def mapped(cfg):
    a = cfg.async_training
    return (a.trigger_parameter_sync_step, a.require_batches, a.staleness_threshold, a.partial_rollout,
            cfg.rollout.colocate, cfg.algorithm.max_staleness)


def test_defaults_the_mapping_compares_with_are_the_yaml_ones():
    cfg = compose("fully_async_ppo_trainer", [])
    for key, default in OURS_DEFAULTS.items():
        assert OmegaConf.select(cfg, key) == default, key
    assert OmegaConf.to_container(cfg.trainer.v1, resolve=True) == V1_DEFAULTS
    assert cfg.trainer.use_v1 is False  # verl_async's fully-async layout stays in charge by default


def test_separate_async_maps_onto_trigger_and_staleness():
    cfg = v(SEPARATE + ["trainer.total_training_steps=3"])
    # P=4 mini-batches of m=2 groups per version, one warmup batch ahead, drop beyond 8 versions
    assert mapped(cfg) == (4, 1, 1.0, True, False, 7)
    assert cfg.trainer.total_training_steps == 12  # 3 V1 steps (versions) x 4 trainer steps
    assert max_required_samples(cfg) == 2 * 4 * 2  # (1 + num_warmup_batches) train batches per version
    assert off_policy_wait(cfg) is None and oldest_first(cfg)


def test_fractional_warmup_is_a_fractional_staleness_threshold():
    cfg = v(SEPARATE + ["trainer.v1.separate_async.num_warmup_batches=0.5"])
    assert cfg.async_training.staleness_threshold == 0.5
    assert max_required_samples(cfg) == 12  # 8 x 1.5


def test_colocate_async_and_sync_run_on_the_trainers_devices():
    cfg = v(V1 + ["trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=2",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.train_batch_size=6",
                  "trainer.n_gpus_per_node=2"])
    # one sync per step of train_batch_size groups, split into 3 mini-batch updates
    assert mapped(cfg) == (1, 3, 2.0, True, True, 7)
    assert (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node) == (1, 2)
    cfg = v(V1 + ["actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.train_batch_size=4"])  # trainer_mode=sync
    assert mapped(cfg) == (1, 2, 0.0, False, True, None)  # on-policy: the drop rule is a no-op there (as in verl)
    assert max_required_samples(cfg) == 4


def test_train_batch_size_zero_takes_verls_rule():
    cfg = v(V1 + ["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    assert cfg.data.train_batch_size == 8 and cfg.async_training.require_batches == 1


@pytest.mark.parametrize("overrides, message", [
    (SEPARATE[:-1] + ["data.train_batch_size=10"],
     "data.train_batch_size: train_batch_size (10) must be divisible by parameter_sync_step (4)"),
    (SEPARATE[:-1] + ["data.train_batch_size=12"],
     "data.train_batch_size: train_batch_size must equal parameter_sync_step * ppo_mini_batch_size in separate async "
     "training, but got train_batch_size=12, parameter_sync_step=4, ppo_mini_batch_size=2"),
    (V1 + ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=6"],
     "data.train_batch_size: train_batch_size (6) must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size "
     "(4): a V1 sync step updates on train_batch_size / ppo_mini_batch_size mini-batches"),
])
def test_verls_batch_rules(overrides, message):
    with pytest.raises(ConfigError) as err:
        v(overrides)
    assert str(err.value) == message


@pytest.mark.parametrize("extra, message", [
    (["async_training.trigger_parameter_sync_step=3"],
     "trainer.v1.separate_async.parameter_sync_step: 4 conflicts with async_training.trigger_parameter_sync_step=3; "
     "set only one"),
    (["async_training.staleness_threshold=0.2"],
     "trainer.v1.separate_async.num_warmup_batches: 1.0 conflicts with async_training.staleness_threshold=0.2; "
     "set only one"),
    (["algorithm.max_staleness=2"],
     "trainer.v1.sampler.max_off_policy_threshold: 8 (-> algorithm.max_staleness=7) conflicts with "
     "algorithm.max_staleness=2; set only one"),
    (["rollout.colocate=true"],
     "trainer.v1.trainer_mode: 'separate_async' (-> rollout.colocate=False) conflicts with rollout.colocate=True; "
     "set only one"),
    (["async_training.require_batches=2"],
     "data.train_batch_size: 8 (-> async_training.require_batches=1) conflicts with async_training.require_batches=2; "
     "set only one"),
    (["rollout.n_gpus_per_node=2", "actor_rollout_ref.rollout.n_gpus_per_node=4"],
     "actor_rollout_ref.rollout.n_gpus_per_node: 4 conflicts with rollout.n_gpus_per_node=2; set only one"),
])
def test_a_v1_key_and_a_fully_async_key_that_disagree_are_one_line(extra, message):
    with pytest.raises(ConfigError) as err:
        v(SEPARATE + extra)
    assert str(err.value) == message


def test_agreeing_keys_and_the_v1_rollout_resources_pass():
    cfg = v(SEPARATE + ["async_training.trigger_parameter_sync_step=4", "algorithm.max_staleness=7",
                        "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2"])
    assert (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node) == (1, 2)
    assert "nnodes" not in cfg.actor_rollout_ref.rollout


@pytest.mark.parametrize("extra, message", [
    (["trainer.v1.separate_async.hybrid_rollout.enable_switch=true"],
     "trainer.v1.separate_async.hybrid_rollout.enable_switch: true: lending idle trainer GPUs to generation is not "
     "implemented"),
    (["trainer.v1.sampler.custom_sampler.path=/x/sampler.py", "trainer.v1.sampler.custom_sampler.name=S"],
     "trainer.v1.sampler.custom_sampler.path: /x/sampler.py: a custom ReplayBuffer class"),
    (["+skip.rollout_tq.enable=true", "+skip.rollout_tq.dump_dir=/tmp/d"],
     "skip.rollout_tq.enable: True: verl's rollout skip"),
    (["actor_rollout_ref.rollout.checkpoint_engine.backend=nixl"],
     "actor_rollout_ref.rollout.checkpoint_engine.backend: unknown value 'nixl'; expected one of: nccl, hccl"),
    (["trainer.v1.sampler.max_off_policy_strategy=keep"],
     "trainer.v1.sampler.max_off_policy_strategy: unknown value 'keep'; expected one of: drop, wait"),
])
def test_refusals_are_one_line_naming_the_key(extra, message):
    with pytest.raises(ConfigError) as err:
        v(SEPARATE + extra)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_naive_backend_and_neutral_skip_keys_are_accepted():
    cfg = v(SEPARATE + ["actor_rollout_ref.rollout.checkpoint_engine.backend=naive", "+skip.rollout_tq.enable=false",
                        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512",
                        "transfer_queue.enable=true", "data.gen_batch_size=1"])
    assert cfg.async_training.sync_transport == "object_store" and cfg.async_training.sync_bucket_size_mb == 512


def test_wait_strategy_and_null_threshold():
    cfg = v(SEPARATE + ["trainer.v1.sampler.max_off_policy_strategy=wait"])
    assert off_policy_wait(cfg) == 8 and cfg.algorithm.max_staleness is None  # dropless
    cfg = v(SEPARATE + ["trainer.v1.sampler.max_off_policy_threshold=null"])
    assert cfg.algorithm.max_staleness is None and off_policy_wait(cfg) is None


def test_v1_keys_without_use_v1_warn_and_do_nothing(caplog):
    reset_compat_warnings()
    with caplog.at_level(logging.WARNING, logger="verl_async.config"):
        cfg = v(["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=3"])
    assert cfg.async_training.trigger_parameter_sync_step == 2 and not oldest_first(cfg)
    assert "trainer.v1.separate_async.parameter_sync_step has no effect with trainer.use_v1=false" in caplog.text
    assert "data.train_batch_size" not in caplog.text


def test_train_batch_size_is_not_called_unused_under_v1(caplog):
    reset_compat_warnings()
    with caplog.at_level(logging.WARNING, logger="verl_async.config"):
        v(SEPARATE)
    assert "data.train_batch_size" not in caplog.text


# --------------------------------------------------------------------------- off_policy.py
def _group(uid, versions_per_response, start=0):
    responses = [Response(token_ids=[1] * len(vs), log_probs=[0.0] * len(vs), versions=list(vs), finish_reason="stop")
                 for vs in versions_per_response]
    return RolloutSample(uid=uid, prompt_ids=[1], responses=responses, param_version_start=start)


def test_trajectory_metrics_hand_values():
    groups = [_group("a", [[3, 3, 4], [5]]), _group("b", [[1, 2, 2]])]
    out = trajectory_metrics(groups, version=5)
    # per response (min, max): (3, 4), (5, 5), (1, 2) -> spans 2, 1, 2; staleness 1, 0, 3; worst 2, 0, 4
    assert out["training/off_policy/trajectory_spans/mean"] == pytest.approx(5 / 3)
    assert (out["training/off_policy/trajectory_spans/max"], out["training/off_policy/trajectory_spans/min"]) == (2, 1)
    assert out["training/off_policy/trajectory_staleness/mean"] == pytest.approx(4 / 3)
    assert out["training/off_policy/trajectory_staleness/max"] == 3
    assert out["training/off_policy/trajectory_staleness_worst/max"] == 4
    assert out["training/off_policy/trajectory_staleness_worst/min"] == 0


def test_inserted_tokens_have_no_version_in_the_metrics():
    g = _group("a", [[2, -1, 3]])
    g.responses[0].loss_mask = [1, 0, 1]
    assert trajectory_metrics([g], 3)["training/off_policy/trajectory_spans/max"] == 2
    assert trajectory_metrics([], 3) == {}


def test_span_and_wait_follow_verls_counts():
    # verl: trained at global step g (weights g-1), submitted at step k (weights k-1): span g - k + 1
    assert span(trainer_version=4, admitted_version=4) == 1 and span(7, 0) == 8
    assert must_wait(7, 0, 8) and not must_wait(6, 0, 8)  # verl waits once the span reaches the threshold
    assert not must_wait(7, None, 8) and not must_wait(100, 0, None)


def test_queue_oldest_first_takes_the_oldest_admitted_groups():
    async def run():
        q = MessageQueue(capacity=8)
        for uid, start in (("a", 3), ("b", 1), ("c", 2), ("d", 1)):
            await q.put(_group(uid, [[start]], start=start))
        first = await q.get_batch(2, timeout=1, oldest_first=True)
        rest = await q.get_batch(2, timeout=1)
        return [g.uid for g in first], [g.uid for g in rest]

    assert asyncio.run(run()) == (["b", "d"], ["a", "c"])  # FIFO among equals; the rest keep their order


def test_trainer_waits_for_the_groups_that_reached_the_threshold(tmp_path, monkeypatch):
    """max_off_policy_strategy=wait: the trainer holds its next step while a group admitted long ago is in flight."""
    import time as _time

    from verl_async.trainer import trainer as trainer_mod
    from verl_async.trainer.trainer import Trainer

    cfg = v(SEPARATE + ["trainer.v1.sampler.max_off_policy_strategy=wait", "trainer.v1.sampler."
                        "max_off_policy_threshold=3", "trainer.logger=[file]", f"trainer.default_local_dir={tmp_path}"])
    answers = [0, 0, 2, None]  # the oldest in-flight group's admission version, poll after poll

    class Method:
        def __init__(self, fn):
            self.remote = fn

    class Rollouter:
        oldest_inflight_version = Method(lambda: answers.pop(0))

    t = Trainer(cfg, queue=None, rollouter=Rollouter(), run_dir=str(tmp_path), run_start=_time.time(), pad_token_id=0)
    monkeypatch.setattr(t, "_call", lambda ref, what, extra_s=0.0: ref)
    monkeypatch.setattr(trainer_mod, "QUEUE_POLL_S", 0.01)
    t.version = 2  # a group admitted under version 0 has spanned 3 versions: wait until it is out
    t._wait_off_policy()
    assert answers == [None]  # polled 0, 0 (wait), then 2 (span 1 < 3): trains
    t.version, answers[:] = 5, [3, 4, 0]
    t._wait_off_policy()
    assert answers == [0]  # the group admitted at 3 spans 3, the threshold: wait; one admitted at 4 spans 2: go
