"""The Trainer's numbers with a stand-in worker group: what is logged is what was measured."""

from __future__ import annotations

import random
import time

import pytest
import torch
from trainer_helpers import compose_config

from verl_async.algos import adaptive_kl_coef, rollout_correction
from verl_async.config import validate
from verl_async.protocol import Response, RolloutSample
from verl_async.trainer.trainer import Trainer

GAP = 0.1  # the stand-in trainer's old log-probs are the rollout's minus GAP


class StandInWorkerGroup:
    """RayWorkerGroup's contract: update() reports the rollout-correction metrics
    (`mismatch/*`) whenever the batch holds `rollout_log_probs`."""

    def __init__(self) -> None:
        self.update_keys: list[set[str]] = []

    def compute_log_prob(self, batch, calculate_entropy=False):
        old = batch["rollout_log_probs"] - GAP * batch["response_mask"]
        return (old, torch.zeros_like(old)) if calculate_entropy else old

    def compute_ref_log_prob(self, batch):
        return batch["rollout_log_probs"].clone()

    def update(self, batch):
        self.update_keys.append(set(batch.keys()))
        out = {"actor/pg_loss": 0.0}
        if "rollout_log_probs" in batch.keys():
            _, _, met = rollout_correction(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"])
            out.update({f"mismatch/{k}": v for k, v in met.items()})
        return out


def groups(count: int = 2, n: int = 2, seed: int = 0) -> list[RolloutSample]:
    rng = random.Random(seed)
    out = []
    for g in range(count):
        responses = []
        for _ in range(n):
            length = rng.randint(1, 6)
            responses.append(Response(token_ids=[rng.randrange(3, 200) for _ in range(length)],
                                      log_probs=[-rng.random() for _ in range(length)], versions=[0] * length,
                                      finish_reason="stop", reward=rng.random()))
        out.append(RolloutSample(uid=f"g{g}", prompt_ids=[5, 6, 7], responses=responses))
    return out


def make_trainer(tmp_path, tiny_model_dir, *overrides: str) -> tuple[Trainer, StandInWorkerGroup]:
    cfg = validate(compose_config(tiny_model_dir, "actor_rollout_ref.rollout.n=2",
                                  "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.logger=[console]",
                                  *overrides))
    wg = StandInWorkerGroup()
    return Trainer(cfg, None, None, run_dir=str(tmp_path), run_start=time.time(), pad_token_id=0,
                   worker_group=wg), wg


def test_bypass_mode_logs_no_mismatch_it_did_not_measure(tmp_path, tiny_model_dir):
    """Bypass: old log-probs ARE the rollout's; a mismatch of 0 would be a number nobody measured."""
    trainer, wg = make_trainer(tmp_path, tiny_model_dir)  # default async_training.use_rollout_log_probs=true
    metrics = trainer.train_step(groups())
    assert not [k for k in metrics if k.startswith("mismatch/")]
    assert "rollout_log_probs" not in wg.update_keys[-1]


def test_recomputed_old_log_probs_log_the_measured_mismatch(tmp_path, tiny_model_dir):
    trainer, wg = make_trainer(tmp_path, tiny_model_dir, "async_training.use_rollout_log_probs=false",
                               "actor_rollout_ref.actor.rollout_correction.enable=true")
    metrics = trainer.train_step(groups())
    assert metrics["mismatch/train_rollout_logprob_abs_diff"] == pytest.approx(GAP, rel=1e-5)
    assert metrics["mismatch/k3_kl"] > 0
    assert "rollout_log_probs" in wg.update_keys[-1]


def test_tokens_are_of_the_trainers_version_only_until_its_first_local_update(tmp_path, tiny_model_dir):
    """trigger_parameter_sync_step=2: the window's second step recomputes with weights one update past version 0."""
    trainer, _ = make_trainer(tmp_path, tiny_model_dir, "async_training.use_rollout_log_probs=false")
    assert trainer.train_step(groups())["mismatch/same_version_token_frac"] == 1.0
    assert trainer.train_step(groups())["mismatch/same_version_token_frac"] == 0.0
    trainer.push_weights()  # no engines here: the push still marks the weights as the version's
    assert trainer.train_step(groups())["mismatch/same_version_token_frac"] == 1.0


# --------------------------------------------------------------------------- adaptive KL control (item 11)
def test_adaptive_kl_coef_hand_values():
    # err = clip(kl / target - 1, -0.2, 0.2); coef * (1 + err * n_steps / horizon)
    assert adaptive_kl_coef(0.1, 0.11, target_kl=0.1, horizon=100, n_steps=8) == pytest.approx(0.1 * 1.008)
    assert adaptive_kl_coef(0.1, 0.15, target_kl=0.1, horizon=100, n_steps=8) == pytest.approx(0.1 * 1.016)  # clipped
    assert adaptive_kl_coef(0.1, 0.0, target_kl=0.1, horizon=100, n_steps=8) == pytest.approx(0.1 * 0.984)  # clipped
    assert adaptive_kl_coef(0.1, 0.1, target_kl=0.1, horizon=100, n_steps=8) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="horizon"):
        adaptive_kl_coef(0.1, 0.1, target_kl=0.1, horizon=0, n_steps=8)


REF_GAP = 0.5  # the stand-in reference's log-probs are the old ones minus REF_GAP: k1 KL = 0.5 per token


class KLWorkerGroup(StandInWorkerGroup):
    def compute_ref_log_prob(self, batch):
        return batch["rollout_log_probs"] - REF_GAP * batch["response_mask"]


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_in_reward_kl_coefficient_follows_kl_ctrl(tmp_path, tiny_model_dir, kind):
    trainer, _ = make_trainer(tmp_path, tiny_model_dir, "algorithm.use_kl_in_reward=true",
                              f"algorithm.kl_ctrl.type={kind}", "algorithm.kl_ctrl.kl_coef=0.01",
                              "algorithm.kl_ctrl.target_kl=0.1", "algorithm.kl_ctrl.horizon=20")
    trainer.wg = KLWorkerGroup()
    used = []
    for step in range(3):
        metrics = trainer.train_step(groups(seed=step))
        assert metrics["critic/kl_in_reward"] == pytest.approx(REF_GAP)
        used.append(metrics["critic/kl_in_reward_coef"])
    # adaptive: KL 0.5 >> target 0.1 -> error clipped to +0.2; 4 responses a step, horizon 20: x1.04 per step
    factor = 1.04 if kind == "adaptive" else 1.0
    assert used == pytest.approx([0.01, 0.01 * factor, 0.01 * factor**2])
    assert trainer.kl_coef == pytest.approx(0.01 * factor**3)


def test_nonfinite_grads_names_the_parameters():
    from verl_async.trainer.rank_results import nonfinite_grads

    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(8)])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model[1].weight.grad[0, 0] = float("nan")
    model[3].bias.grad[1] = float("inf")
    assert nonfinite_grads(model.named_parameters()) == ["1.weight", "3.bias"]
    for i in range(8):
        model[i].weight.grad[0, 0] = float("nan")
    assert nonfinite_grads(model.named_parameters(), limit=2) == ["0.weight", "1.weight", "... 7 more"]
