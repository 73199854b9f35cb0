"""Helpers of the trainer tests: Hydra config for the tiny model, random train batches."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from verl_async.protocol import Response, RolloutSample, collate_groups

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "config")


def compose_config(model_dir: str, *overrides: str, config_name: str = "fully_async_ppo_trainer"):
    from hydra import compose, initialize_config_dir

    import verl_async.config  # noqa: F401 - registers the YAML's resolvers

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name, overrides=[f"actor_rollout_ref.model.path={model_dir}", *overrides])


def make_batch(groups: int = 4, n: int = 2, *, seed: int = 0, vocab: int = 250, prompt_len=(2, 8),
               response_len=(1, 10), empty_response_rows: int = 0):
    """collate_groups batch of random tokens (ids >= 3: no special tokens), scores in [0, 1)."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))]
        responses = []
        for _ in range(n):
            length = rng.randint(*response_len)
            if empty_response_rows > 0:
                length, empty_response_rows = 0, empty_response_rows - 1
            responses.append(Response(token_ids=[rng.randrange(3, vocab) for _ in range(length)],
                                      log_probs=[-rng.random() for _ in range(length)], versions=[0] * length,
                                      finish_reason="stop", reward=rng.random()))
        samples.append(RolloutSample(uid=f"g{g}", prompt_ids=prompt, responses=responses))
    return collate_groups(samples, pad_token_id=0)


def with_advantages(batch, *, seed: int = 0, scale: float = 1.0):
    """GRPO-like per-row advantages broadcast over the response (0 on padding)."""
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randn(batch.batch_size[0], 1, generator=gen) * scale
    batch["advantages"] = (adv * batch["response_mask"]).contiguous()
    return batch
