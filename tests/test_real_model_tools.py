"""Multi-turn with the real model (SmolLM2-135M-Instruct, CPU): its chat template, its engine, the tools on.

The 135M model seldom writes a tool call by itself, so the first test forces its first
turn to be one (a wrapper engine answers turn 1 with a scripted call) and checks that
the real engine then continues the trajectory with the tool's answer in its context: the
second turn's log-probs equal a plain HF forward over prompt + first turn + tool answer.
A short training through `python -m recipe.fully_async_main` with the calculator on, as a
user would, is the real-model GRPO run (tests/test_real_model.py TestGrpoThroughTheEntryPoint):
one real-model run for both.
"""

from __future__ import annotations

import asyncio

import torch

from data_preprocess import arithmetic_tools
from tests.agent_fakes import call
from tests.fakes import ListSink, ListSource, no_score
from tests.test_real_model import model_dir, pytestmark  # noqa: F401 - the same marks and model fixture
from verl_async.rollout.engine import DelegatingEngine, GenerateRequest, GenerateResult, SamplingParams


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
