"""The FSDP2 worker group on CUDA (bf16 mixed precision, NCCL, offloaded reference). Skipped without GPUs.

    pytest -q -m gpu tests/trainer/test_trainer_gpu.py        # one GPU
    pytest -q -m multigpu tests/trainer/test_trainer_gpu.py   # two GPUs
"""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import compose_config, make_batch, with_advantages

from verl_async.trainer import FSDPWorkerGroup
from verl_async.sync.object_store import full_weights


def _group(model_dir: str, world: int, attn: str) -> FSDPWorkerGroup:
    a = "actor_rollout_ref.actor"
    cfg = compose_config(
        model_dir, "trainer.device=cuda", f"trainer.n_gpus_per_node={world}", "trainer.worker_timeout_s=300",
        f"actor_rollout_ref.model.attn_implementation={attn}", "actor_rollout_ref.rollout.n=2",
        f"{a}.ppo_mini_batch_size=8", f"{a}.use_kl_loss=true", f"{a}.ppo_max_token_len_per_gpu=256",
        f"{a}.optim.lr=1e-4",
    )
    group = FSDPWorkerGroup(cfg, name=f"gpu_test_{world}_{attn}")
    group.init()
    return group


def _check_group(group: FSDPWorkerGroup) -> None:
    batch = with_advantages(make_batch(groups=8, n=2, seed=1, prompt_len=(4, 40), response_len=(1, 60)), seed=2)
    mask = batch["response_mask"].bool()
    logp = group.compute_log_prob(batch)
    ref = group.compute_ref_log_prob(batch)
    assert torch.equal(logp, ref), "offloaded reference == actor on the first step (KL = 0)"
    group.set_options(use_remove_padding=False, log_prob_use_dynamic_bsz=False, log_prob_micro_batch_size_per_gpu=4)
    padded = group.compute_log_prob(batch)
    group.set_options(use_remove_padding=True, log_prob_use_dynamic_bsz=True)
    assert float((padded - logp)[mask].abs().max()) < 0.1, "packed vs padded (bf16)"
    batch["old_log_probs"], batch["ref_log_prob"] = logp, ref
    m = group.update(batch)
    assert m["actor/optimizer_steps"] == 1.0 and m["actor/skipped_steps"] == 0.0
    assert abs(m["actor/ppo_kl"]) < 1e-3 and m["actor/grad_norm"] > 0
    assert m["perf/max_memory_allocated_gb"] > 0
    after = group.compute_log_prob(batch)
    assert not torch.equal(after, logp), "the update moved the policy"
    names = [n for n, _ in full_weights(group, 1 << 20, dtype="bfloat16")]
    assert "model.embed_tokens.weight" in names


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
def test_one_gpu_bf16_step(ray_session, tiny_model_dir, attn):
    group = _group(tiny_model_dir, 1, attn)
    try:
        _check_group(group)
    finally:
        group.shutdown()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_two_gpus_nccl_step(ray_session, tiny_model_dir):
    group = _group(tiny_model_dir, 2, "varlen")
    try:
        _check_group(group)
    finally:
        group.shutdown()
