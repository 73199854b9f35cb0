"""Every model family the README names, small and random, through the native engine and the trainer.

A family whose attention, masks or sliding window the engine or the trainer gets wrong
shows here on CPU, in float32, where both must equal the plain HF forward. Qwen2 runs
with mixed layer kinds (one full, one sliding layer: the per-kind mask dict), Mistral
with a window shorter than the sequences (every layer slides), Llama and Qwen3 plain.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from trainer_helpers import compose_config, with_advantages

from verl_async.models.loading import load_causal_lm
from verl_async.models.tiny import build_tiny_model_dir
from verl_async.protocol import Response, RolloutSample, collate_groups
from verl_async.rollout.engine import GenerateRequest, SamplingParams
from verl_async.rollout.native import NativeEngine
from verl_async.trainer import FSDPWorkerGroup

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WINDOW = 8
FAMILIES = {
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {},
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
}
TEMPERATURE = 0.8
PROMPTS = [[5, 9, 30, 41, 7], [100, 3], [17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [250], [64, 65, 66]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    folder = build_tiny_model_dir(str(tmp_path_factory.mktemp(name)), family=name, **FAMILIES[name])
    model = load_causal_lm(folder, attn_implementation="sdpa").eval().requires_grad_(False)
    return name, folder, model


def hf_log_probs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The plain HF forward of one unpadded sequence: log_softmax(logits / T)[token]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def generate(model) -> list[Response]:
    async def main():
        engine = NativeEngine(model=model, max_num_seqs=3, max_model_len=64)  # 5 requests, 3 slots: batched prefill
        try:
            requests = [GenerateRequest(f"r{i}", p, SamplingParams(temperature=TEMPERATURE, max_tokens=20 + i,
                                                                  ignore_eos=True, seed=i))
                        for i, p in enumerate(PROMPTS)]
            return await asyncio.wait_for(asyncio.gather(*(engine.generate(r) for r in requests)), 60)
        finally:
            await engine.shutdown()

    results = asyncio.run(main())
    for r in results:
        assert r.error is None, r.error
    return [Response(token_ids=r.token_ids, log_probs=r.log_probs, versions=r.versions, finish_reason=r.finish_reason)
            for r in results]


def test_native_engine_log_probs_equal_hf_forward(family):
    name, _, model = family
    responses = generate(model)
    for prompt, response in zip(PROMPTS, responses):
        assert len(prompt) + len(response.token_ids) > WINDOW  # the window matters
        ref = hf_log_probs(model, prompt, response.token_ids)
        gap = float((torch.tensor(response.log_probs) - ref).abs().max())
        assert gap < 1e-5, f"{name}: engine vs HF log-prob gap {gap:.2e}"


def test_trainer_recomputes_the_engine_log_probs_and_updates(ray_session, family):
    name, folder, model = family
    responses = generate(model)
    samples = [RolloutSample(uid=f"g{i}", prompt_ids=PROMPTS[i], responses=[responses[i]], data_source="x")
               for i in range(len(PROMPTS))]
    for s, r in zip(samples, responses):
        r.reward = float(len(r.token_ids) % 2)
    batch = with_advantages(collate_groups(samples, pad_token_id=0), seed=0)
    a = "actor_rollout_ref.actor"
    cfg = compose_config(folder, "actor_rollout_ref.rollout.n=1", f"{a}.ppo_mini_batch_size=5",
                         f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", f"{a}.ppo_max_token_len_per_gpu=64",
                         "trainer.worker_timeout_s=120")
    group = FSDPWorkerGroup(cfg, name=f"family_{name}")
    try:
        group.init()
        logp = group.compute_log_prob(batch)
        logp = logp[0] if isinstance(logp, tuple) else logp
        mask = batch["response_mask"].bool()
        gap = float((logp - batch["rollout_log_probs"]).abs()[mask].max())
        assert gap < 1e-4, f"{name}: trainer vs engine log-prob gap {gap:.2e}"
        batch["old_log_probs"] = logp
        metrics = group.update(batch)
        assert metrics["actor/optimizer_steps"] == 1.0
        assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"])) and metrics["actor/grad_norm"] > 0
    finally:
        group.shutdown()


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cpu", "bfloat16"),
                                           pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)])
def test_true_on_policy_trainer_recomputes_the_engine_log_probs_bitwise(family, device, dtype):
    """true_on_policy: engine (batched prefill, continuous decode) == FSDP2 trainer (packed, split), bit for bit;
    windows shorter than the sequences and mixed layer kinds included."""
    from onpolicy_helpers import PROMPTS as PROMPTS_24, batch_of, generate, log_probs, rank

    name, folder, _ = family
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    results = generate(folder, dtype=torch_dtype, true_on_policy=True, device=device)
    batch = batch_of(PROMPTS_24, results)
    assert max(len(p) + len(r.token_ids) for p, r in zip(PROMPTS_24, results)) > WINDOW
    worker = rank(folder, true_on_policy=True, bf16=dtype == "bfloat16", device=device)
    try:
        mask = batch["response_mask"].bool()
        for split in ([[0, 1, 2, 3, 4]], [[0, 3], [1, 2, 4]]):
            logp = log_probs(worker, batch, split)
            assert torch.equal(logp[mask], batch["rollout_log_probs"][mask]), f"{name} {dtype} {split}"
    finally:
        worker.shutdown()
