"""True on-policy mode on CPU: the native engine's sampling log-probs ARE the trainer's, bit for bit.

A tiny Llama (GQA) in float32 and bf16 on CPU (the FSDP2 rank with bf16 mixed precision, as on a GPU)
and in bf16 on CUDA (`-m gpu`), an in-process engine and an in-process FSDP2 rank. Equality must hold whatever the engine batched
together (max_num_seqs 1 or 5: prefill alone or right-padded with others, rows compacted as others
finish) and however the trainer splits and lays out the rows (one micro-batch, one row each, a
mixed split; packed and padded), in the no-grad recompute and in the training forward (the PPO
ratio of the first mini-batch is exactly 1), and across a weight sync that interrupts responses
and continues them under the new weights. With the mode off the same comparison is NOT equal, so
the mode is what makes it hold.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from onpolicy_helpers import (PROMPTS, batch_of, engine_for, generate, log_probs, rank, requests, run_requests,
                              train_step)

from verl_async.models.tiny import build_tiny_model_dir

pytestmark = pytest.mark.timeout(300)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CASES = [pytest.param("cpu", "float32", id="cpu-float32"), pytest.param("cpu", "bfloat16", id="cpu-bfloat16"),
         pytest.param("cuda", "bfloat16", id="cuda-bfloat16", marks=pytest.mark.gpu)]
SPLITS = {"one": [[0, 1, 2, 3, 4]], "each": [[0], [1], [2], [3], [4]], "mixed": [[0, 3], [1, 2, 4]]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_llama")), family="llama")


def _rank(model_dir, device: str, dtype: str, on: bool, *overrides: str):
    return rank(model_dir, *overrides, true_on_policy=on, bf16=dtype == "bfloat16", device=device)


def _valid(batch) -> torch.Tensor:
    return batch["response_mask"].bool()


def _rollouts(model_dir, device: str, dtype: str, on: bool):
    """The engine's batch, its log-probs and the response-token mask."""
    batch = batch_of(PROMPTS, generate(model_dir, dtype=DTYPES[dtype], true_on_policy=on, device=device))
    return batch, batch["rollout_log_probs"], _valid(batch)


@pytest.mark.parametrize("device, dtype", CASES)
def test_engine_log_probs_do_not_depend_on_what_was_batched_with_them(model_dir, device, dtype):
    reqs = requests(max_tokens=8)
    alone = generate(model_dir, dtype=DTYPES[dtype], true_on_policy=True, max_num_seqs=1, reqs=reqs,
                     device=device)
    together = generate(model_dir, dtype=DTYPES[dtype], true_on_policy=True, max_num_seqs=5, reqs=reqs,
                        device=device)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert torch.equal(torch.tensor(a.log_probs), torch.tensor(b.log_probs))


@pytest.mark.parametrize("device, dtype", CASES)
def test_trainer_recomputes_the_engine_log_probs_bitwise(model_dir, device, dtype):
    batch, rollout, valid = _rollouts(model_dir, device, dtype, True)
    worker = _rank(model_dir, device, dtype, True)
    try:
        for packed in (True, False):
            worker.set_options({"use_remove_padding": packed})
            for name, split in SPLITS.items():
                ours = log_probs(worker, batch, split)
                assert torch.equal(ours[valid], rollout[valid]), (packed, name, (ours - rollout)[valid].abs().max())
        worker.set_options({"use_remove_padding": True})
        metrics = train_step(worker, batch, rollout)  # the training forward, with autograd, against the engine's
        assert metrics["actor/first_minibatch_ratio_dev_max"] == 0.0
        assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/grad_norm"] > 0
    finally:
        worker.shutdown()


@pytest.mark.parametrize("device, dtype", CASES)
def test_with_the_mode_off_they_differ(model_dir, device, dtype):
    batch, rollout, valid = _rollouts(model_dir, device, dtype, False)
    worker = _rank(model_dir, device, dtype, False)
    try:
        ours = log_probs(worker, batch, SPLITS["one"])
        gap = (ours - rollout)[valid].abs().max()
        assert not torch.equal(ours[valid], rollout[valid])
        if dtype == "float32":
            assert gap < 1e-4  # close, as the mode-off tests require, but not equal
        assert train_step(worker, batch, rollout)["actor/first_minibatch_ratio_dev_max"] > 0.0
    finally:
        worker.shutdown()


@pytest.mark.parametrize("device, dtype", CASES)
def test_equal_across_a_weight_sync_that_interrupts_responses(model_dir, device, dtype):
    """Responses are aborted mid-way, the trainer steps, its weights go to the engine, the responses
    continue from their prefix (a prefill of prompt + prefix): every token equals the trainer's
    recomputation under the weights that sampled it."""
    worker = _rank(model_dir, device, dtype, True)
    engine = engine_for(model_dir, dtype=DTYPES[dtype], true_on_policy=True, max_num_seqs=len(PROMPTS), device=device)
    sync_dtype = DTYPES[dtype]
    try:
        asyncio.run(engine.update_weights(list(worker.iter_full_params(sync_dtype)), version=0))

        async def interrupted():
            reqs = requests(max_tokens=40)
            tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
            while min(engine.progress(r.request_id) for r in reqs) < 3:  # all running (one slot each), 3+ tokens
                await asyncio.sleep(0.005)
            await engine.abort()
            return await asyncio.gather(*tasks)

        first = asyncio.run(interrupted())
        assert all(r.finish_reason == "abort" and r.error is None and r.token_ids for r in first)
        before = log_probs(worker, batch_of(PROMPTS, first), SPLITS["one"])  # version 0's view of the prefixes
        train_step(worker, batch_of(PROMPTS, first), before)
        asyncio.run(engine.update_weights(list(worker.iter_full_params(sync_dtype)), version=1))
        final = run_requests(engine, requests(max_tokens=40, prefixes=first))
        batch = batch_of(PROMPTS, final)
        after = log_probs(worker, batch, SPLITS["mixed"])
        versions, valid = batch["token_versions"], _valid(batch)
        old = valid & (versions == 0)
        new = valid & (versions == 1)
        assert old.any() and new.any()
        width = before.shape[1]
        assert torch.equal(batch["rollout_log_probs"][:, :width][old[:, :width]], before[old[:, :width]])
        assert torch.equal(batch["rollout_log_probs"][new], after[new])
    finally:
        engine.close()
        worker.shutdown()
