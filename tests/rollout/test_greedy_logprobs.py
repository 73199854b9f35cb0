"""Greedy rollouts (`rollout.do_sample=false`): the engine's log-probs are the ones the trainer recomputes."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omegaconf import OmegaConf

from verl_async.algos import logprob_temperature, logprobs_from_logits
from verl_async.config import compose, validate
from verl_async.models.loading import load_causal_lm
from verl_async.rollout.engine import GenerateRequest
from verl_async.rollout.native import NativeEngine
from verl_async.rollout.service import sampling_from
from verl_async.trainer.settings import TrainerSettings

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 9, 30, 41, 7], [100, 3], [17, 18, 19, 20, 21, 22]]


def test_logprob_temperature():
    assert logprob_temperature(0.7) == 0.7 and logprob_temperature(0.0) == 1.0
    assert logprob_temperature(0.7, do_sample=False) == 1.0  # greedy: the model's own distribution
    with pytest.raises(ValueError, match="temperature"):
        logprob_temperature(-1.0)


@pytest.mark.parametrize("do_sample", [False, True])
def test_engine_and_trainer_log_probs_agree(tiny_model_dir, do_sample):
    cfg = validate(compose(overrides=[
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"actor_rollout_ref.rollout.do_sample={do_sample}",
        "actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.ignore_eos=true",
        "data.max_response_length=12",
    ]))
    rollout = cfg.actor_rollout_ref.rollout
    sampling = sampling_from(rollout, eos_ids=())
    assert (sampling.temperature == 0.0) is (not do_sample)
    settings = TrainerSettings.from_config(OmegaConf.to_container(cfg, resolve=True))
    model = load_causal_lm(tiny_model_dir, attn_implementation="sdpa").eval().requires_grad_(False)

    async def generate():
        engine = NativeEngine(model=model, max_num_seqs=4, max_model_len=64)
        try:
            reqs = [GenerateRequest(f"r{i}", p, sampling) for i, p in enumerate(PROMPTS)]
            return await asyncio.gather(*[engine.generate(r) for r in reqs])
        finally:
            await engine.shutdown()

    results = asyncio.run(asyncio.wait_for(generate(), timeout=90))
    for prompt, res in zip(PROMPTS, results):
        assert res.ok and len(res.token_ids) == rollout.response_length
        ids = torch.tensor([prompt + res.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[:, len(prompt) - 1 : -1]
        if not do_sample:
            assert logits.argmax(-1)[0].tolist() == res.token_ids  # greedy indeed
        # what the trainer's forward computes (fsdp_worker / megatron worker: settings.temperature)
        trainer = logprobs_from_logits(logits, torch.tensor([res.token_ids]), settings.temperature)[0]
        gap = (trainer - torch.tensor(res.log_probs)).abs().max().item()
        assert gap < 1e-4, (do_sample, settings.temperature, gap)
