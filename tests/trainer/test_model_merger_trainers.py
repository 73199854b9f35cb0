"""A trainer trains a few steps and checkpoints; `python -m verl_async.model_merger merge` (a fresh process,
no Ray, no GPU) turns the checkpoint into an HF folder whose log-probs are the trainer's at that step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_helpers import compose_config, make_batch, with_advantages

pytestmark = pytest.mark.slow
REPO = str(Path(__file__).resolve().parents[2])
A = "actor_rollout_ref.actor"


def overrides(world: int, *extra: str) -> list[str]:
    return [f"trainer.n_gpus_per_node={world}", "actor_rollout_ref.rollout.n=2", f"{A}.ppo_mini_batch_size=2",
            f"{A}.optim.lr=0.05", f"{A}.use_dynamic_bsz=true", f"{A}.ppo_max_token_len_per_gpu=64",
            f"{A}.checkpoint.save_contents=[model,optimizer,extra,hf_model]", "trainer.worker_timeout_s=180", *extra]


def train_and_checkpoint(group, root: str):
    """Two updates, a checkpoint, and the trainer's log-probs of a batch at that step."""
    batch = with_advantages(make_batch(groups=4, n=2, seed=7), seed=2)
    for _ in range(2):
        batch["old_log_probs"] = group.compute_log_prob(batch)
        group.update(batch)
    path = group.save_checkpoint(root, extra={}, step=2)
    return path, batch, group.compute_log_prob(batch)


def merge_cli(backend: str, local_dir: str, target: str) -> str:
    env = dict(os.environ, PYTHONPATH=REPO, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "verl_async.model_merger", "merge", "--backend", backend,
                           "--local_dir", local_dir, "--target_dir", target], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def hf_log_probs(path: str, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of the batch's responses, full logits) of the HF folder, as the trainer computes them."""
    from transformers import AutoModelForCausalLM

    from verl_async.algos import logprobs_from_logits
    from verl_async.trainer.batching import build_model_inputs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    inputs = build_model_inputs(batch, list(range(batch.batch_size[0])), packed=False, pad_token_id=0)
    with torch.no_grad():
        logits = model(**inputs.model_kwargs()).logits
    return inputs.scatter(logprobs_from_logits(logits, inputs.labels, 1.0)), logits


def check_merged(backend: str, path: str, batch, trainer_logp: torch.Tensor, tmp_path) -> None:
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(os.path.join(path, "huggingface")))
    merged = merge_cli(backend, path, str(tmp_path / "merged"))
    logp, logits = hf_log_probs(merged, batch)
    assert torch.allclose(logp, trainer_logp, atol=1e-5, rtol=0), (logp - trainer_logp).abs().max()
    # the folder the checkpoint wrote itself (save_contents hf_model): the same model, bit for bit
    beside_logp, beside_logits = hf_log_probs(os.path.join(path, "huggingface"), batch)
    assert torch.equal(logits, beside_logits) and torch.equal(logp, beside_logp)


def test_fsdp_checkpoint_merges_to_the_trainers_model(ray_session, tiny_model_dir, tmp_path):
    from verl_async.trainer import FSDPWorkerGroup

    group = FSDPWorkerGroup(compose_config(tiny_model_dir, *overrides(2)), name="merger_fsdp")
    try:
        group.init()
        path, batch, trainer_logp = train_and_checkpoint(group, str(tmp_path / "ckpt"))
    finally:
        group.shutdown()
    check_merged("fsdp", path, batch, trainer_logp, tmp_path)


@pytest.mark.megatron
def test_megatron_checkpoint_merges_to_the_trainers_model(ray_session, tiny_model_dir, tmp_path):
    from verl_async.trainer.megatron.worker_group import MegatronWorkerGroup

    cfg = compose_config(tiny_model_dir, *overrides(2, f"{A}.megatron.pipeline_model_parallel_size=2",
                                                    f"{A}.megatron.use_distributed_optimizer=false"),
                         config_name="fully_async_ppo_megatron_trainer")
    group = MegatronWorkerGroup(cfg, name="merger_megatron")
    try:
        group.init()
        path, batch, trainer_logp = train_and_checkpoint(group, str(tmp_path / "ckpt"))
    finally:
        group.shutdown()
    assert {"names_pp0.json", "names_pp1.json"} <= set(os.listdir(os.path.join(path, "megatron")))
    check_merged("megatron", path, batch, trainer_logp, tmp_path)
