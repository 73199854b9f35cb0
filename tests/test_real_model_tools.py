"""Multi-turn with the real model (SmolLM2-135M-Instruct, CPU): its chat template, its engine, the tools on.

The 135M model seldom writes a tool call by itself, so the first test forces its first
turn to be one (a wrapper engine answers turn 1 with a scripted call) and checks that
the real engine then continues the trajectory with the tool's answer in its context: the
second turn's log-probs equal a plain HF forward over prompt + first turn + tool answer.
The second runs a short training through `python -m recipe.fully_async_main` with the
calculator on, as a user would.
"""

from __future__ import annotations

import asyncio
import os

import torch

from data_preprocess import arithmetic_tools
from tests.agent_fakes import call
from tests.fakes import ListSink, ListSource, no_score
from tests.test_real_model import MODEL, REPO, model_dir, pytestmark  # noqa: F401 - the same marks and model fixture
from tests.entry_point import run_main
from verl_async.data import write_rows
from verl_async.rollout.engine import DelegatingEngine, GenerateRequest, GenerateResult, SamplingParams

CONFIG = os.path.join(REPO, "config", "tool_config", "calculator_tool_config.yaml")


class ForcedFirstTurn(DelegatingEngine):
    """The first turn of every response is `text` (then EOS); later turns are the real engine's."""

    def __init__(self, inner, tokenizer, text: str) -> None:
        super().__init__(inner)
        self.ids = list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.prefix_token_ids:
            return await self.inner.generate(request)
        return GenerateResult(request.request_id, list(self.ids), [-1.0] * len(self.ids), [0] * len(self.ids), "stop")


def test_the_real_engine_continues_after_the_tool_answer(model_dir):
    from verl_async.models.loading import load_causal_lm, load_tokenizer
    from verl_async.rollout.agent_loop import MultiTurnSettings, ToolAgentLoop
    from verl_async.rollout.native import NativeEngine
    from verl_async.rollout.rollouter import PromptTask, Rollouter
    from verl_async.staleness import StalenessBudget
    from verl_async.tools.calculator import CalculatorTool

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, attn_implementation="sdpa").eval().requires_grad_(False)
    loop = ToolAgentLoop({"calculator": CalculatorTool({})}, tok, MultiTurnSettings(max_assistant_turns=2), budget=72)
    row = arithmetic_tools.generate_splits("calculator", 1, 1, seed=3)["test"][0]
    prompt = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True, tools=loop.schemas)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    forced = call("calculator", expression="17 + 25")

    async def main():
        engine = NativeEngine(model=model, max_num_seqs=2, max_model_len=1024)
        try:
            ro = Rollouter(engines=[ForcedFirstTurn(engine, tok, forced)],
                           prompts=ListSource([PromptTask("q", 0, 0, prompt_ids, agent_name="tool_agent")]),
                           scorer=no_score, sink=sink, n=2,
                           sampling=SamplingParams(temperature=0.7, max_tokens=72, stop_token_ids=(tok.eos_token_id,),
                                                   seed=0),
                           budget=StalenessBudget(10), partial_rollout=True, max_inflight_groups=1, agent_loop=loop)
            await asyncio.wait_for(ro.run(), 300)
        finally:
            await engine.shutdown()

    sink = ListSink()
    asyncio.run(main())
    for r in sink.groups[0].responses:
        first = len(tok.encode(forced, add_special_tokens=False)) + 1
        answer = tok.decode(r.token_ids[first:r.loss_mask.index(1, first)])
        assert answer == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
        second = [k for k in range(first, len(r)) if r.loss_mask[k]]
        assert second and r.agent_info["tool_calls"] == 1 and r.agent_info["assistant_turns"] == 2
        assert r.finish_reason in ("stop", "length") and all(r.versions[k] == 0 for k in second)
        # the engine's log-probs of the second turn are the model's over the whole multi-turn context
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + r.token_ids])).logits[0].float()
        positions = torch.tensor([len(prompt_ids) + k - 1 for k in second])
        ref = torch.log_softmax(logits[positions] / 0.7, -1).gather(-1, torch.tensor([[r.token_ids[k]] for k in second]))
        assert float((torch.tensor([r.log_probs[k] for k in second]) - ref[:, 0]).abs().max()) < 1e-4


def test_training_through_the_entry_point_with_tools_on(ray_session, tmp_path):
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
        "actor_rollout_ref.rollout.multi_turn.enable=true", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={CONFIG}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "reward_model.gsm8k_method=flexible", "trainer.val_before_train=false", "trainer.test_freq=2",
        "trainer.logger=[console,tensorboard]", f"trainer.default_local_dir={run_dir}",
        f"hydra.run.dir={tmp_path / 'hydra'}", "ray_init.num_cpus=4",
    ]
    proc = run_main(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scalars = read_scalars(str(run_dir))
    assert len(scalars["actor/pg_loss"]) == 2
    assert scalars["multi_turn/trajectories_total"][-1].value == 8.0  # 4 prompts x n=2, each one trajectory
    assert scalars["val/multi_turn/trajectories_total"][-1].value == 2.0
    for key in ("multi_turn/turns/mean", "multi_turn/tool_call_rate", "multi_turn/masked_token_share",
                "multi_turn/ended_by_turn_limit"):
        assert key in scalars, key
