"""The multi-turn agent loop inside the Rollouter, driven by a scripted engine that writes tool calls.

Each test makes one thing happen (a call, a malformed call, a tool that raises, hangs or
floods, a turn limit, the response budget, a weight sync mid-turn) and checks the one
response the trajectory becomes: its text, loss mask, log-probs, versions and what the
reward function and the metrics get.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tests.agent_fakes import ScriptedToolEngine, call
from tests.fakes import ListSink, ListSource, no_score
from verl_async.models.tiny import build_char_tokenizer
from verl_async.rollout.agent_loop import MultiTurnSettings, ToolAgentLoop
from verl_async.rollout.engine import SamplingParams
from verl_async.rollout.rollouter import PromptTask, Rollouter
from verl_async.staleness import StalenessBudget
from verl_async.tools import BaseTool, ToolResponse
from verl_async.tools.calculator import CalculatorTool

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
PROMPT = TOK.encode("<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


class Tool(BaseTool):
    """Test tool: `behaviour(arguments)` is awaited for the answer; records lifecycles."""

    def __init__(self, name: str, behaviour, step_reward: float = 0.0, final_reward: float = 0.0):
        super().__init__({}, _schema(name))
        self.behaviour, self.step_reward, self.final_reward = behaviour, step_reward, final_reward
        self.created, self.released, self.kwargs = [], [], []

    async def create(self, instance_id=None, **kwargs):
        self.created.append(kwargs.get("create_kwargs"))
        return f"inst{len(self.created)}", ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        self.kwargs.append(kwargs)
        return ToolResponse(text=str(await self.behaviour(parameters))), self.step_reward, {}

    async def calc_reward(self, instance_id, **kwargs):
        return self.final_reward

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


def _schema(name):
    from verl_async.tools.schemas import OpenAIFunctionToolSchema

    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {"name": name, "description": name}})


def build(script, tools, *, n=1, prompts=1, budget=400, token_delay=0.001, partial=True, engines=1,
          items=None, **settings):
    engine_list = [ScriptedToolEngine(TOK, script, token_delay=token_delay) for _ in range(engines)]
    loop = ToolAgentLoop({t.name: t for t in tools}, TOK, MultiTurnSettings(**settings), budget=budget)
    sink = ListSink()
    items = items or [PromptTask(f"p{k}", k, 0, list(PROMPT)) for k in range(prompts)]
    ro = Rollouter(engines=engine_list, prompts=ListSource(items), scorer=no_score, sink=sink, n=n,
                   sampling=SamplingParams(max_tokens=budget, stop_token_ids=(EOS,), seed=0),
                   budget=StalenessBudget(100), partial_rollout=partial, max_inflight_groups=8, agent_loop=loop)
    return ro, loop, engine_list, sink


def run(ro, timeout=30):
    asyncio.run(asyncio.wait_for(ro.run(), timeout))


def segments(response):
    """The response as [(mask, text)] runs."""
    out = []
    for token, m in zip(response.token_ids, response.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(token)
        else:
            out.append((m, [token]))
    return [(m, TOK.decode(ids)) for m, ids in out]


def calc_then_answer(uid, i, turn, context):
    return ["I will compute. " + call("calculator", expression="6*7"), "The answer is 42."][turn]


# ------------------------------------------------------------------ one trajectory
def test_a_tool_call_becomes_one_response_with_a_loss_mask():
    ro, loop, (engine,), sink = build(calc_then_answer, [CalculatorTool({})], n=2)
    run(ro)
    (group,) = sink.groups
    assert len(group.responses) == 2
    r = group.responses[0]
    first = "I will compute. " + call("calculator", expression="6*7") + "<|im_end|>"
    assert segments(r) == [
        (1, first),
        (0, "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"),  # the template's glue and the answer
        (1, "The answer is 42.<|im_end|>"),
    ]
    model = [k for k, m in enumerate(r.loss_mask) if m]
    inserted = [k for k, m in enumerate(r.loss_mask) if not m]
    assert all(r.log_probs[k] == -0.25 and r.versions[k] == 0 for k in model)
    assert all(r.log_probs[k] == 0.0 and r.versions[k] == -1 for k in inserted)
    assert r.finish_reason == "stop" and r.min_version == r.max_version == 0
    assert r.agent_info == {"num_turns": 4, "assistant_turns": 2, "user_turns": 1, "tool_calls": 1,
                            "tool_rewards": [0.0], "turn_scores": [], "rollout_reward_scores": {"calculator": 0.0},
                            "stop_reason": "no_call"}  # num_turns as verl counts: + 1 for the prompt
    # the second turn was generated on the prompt, the first turn and the tool answer
    assert engine.contexts[("p0", 0, 1)] == TOK.decode(PROMPT) + first + "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    m = loop.stats.metrics()
    assert m["multi_turn/turns/mean"] == 2.0 and m["multi_turn/tool_calls/mean"] == 1.0
    assert m["multi_turn/tool_success_rate"] == 1.0 and m["multi_turn/ended_by_no_call"] == 1.0
    assert m["multi_turn/masked_token_share"] == pytest.approx(len(inserted) / len(r))
    assert m["multi_turn/trajectories_total"] == 2.0


def test_calls_of_a_turn_run_concurrently_up_to_max_parallel_calls():
    spans = []

    async def slow(args):
        start = time.monotonic()
        await asyncio.sleep(0.4)
        spans.append((start, time.monotonic()))
        return args["x"]

    tool = Tool("slow", slow)
    script = lambda uid, i, turn, ctx: [call("slow", x=1) + call("slow", x=2) + call("slow", x=3), "done"][turn]
    ro, loop, _, sink = build(script, [tool], max_parallel_calls=2)
    run(ro)
    # two calls at once, not one after the other: each started before the other ended (no wall-clock bound,
    # which a loaded machine breaks)
    assert len(spans) == 2 and max(s for s, _ in spans) < min(e for _, e in spans)
    text = TOK.decode(sink.groups[0].responses[0].token_ids)
    assert "<|im_start|>tool\n1<|im_end|>\n<|im_start|>tool\n2<|im_end|>" in text and "tool\n3" not in text
    assert loop.stats.metrics()["multi_turn/dropped_calls_total"] == 1.0
    assert tool.created == [{}] and tool.released == ["inst1"]  # one instance per trajectory


def test_malformed_unknown_and_bad_argument_calls():
    """Each is answered to the model as an error and counted; the trajectory goes on (issue 36)."""
    script = lambda uid, i, turn, ctx: [
        '<tool_call>{"name": "calculator", "arguments": {oops}</tool_call>' + call("nope", a=1)
        + '<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>',
        '<tool_call>{"name": "calculator"',  # never closed: answered too
        "done",
    ][turn]
    ro, loop, _, sink = build(script, [CalculatorTool({})], max_parallel_calls=4, budget=1500)
    run(ro)
    r = sink.groups[0].responses[0]
    first, second = [text for m, text in segments(r) if m == 0]
    assert "Error: the tool call is not valid JSON" in first
    assert "Unknown function 'nope'. Available tools: ['calculator']" in first
    assert "Invalid arguments for 'calculator': expected a JSON object, got '[1, 2]'" in first
    assert "Error: a <tool_call> block was not closed with </tool_call>" in second
    assert r.agent_info["stop_reason"] == "no_call" and r.agent_info["tool_calls"] == 4
    m = loop.stats.metrics()
    assert m["multi_turn/malformed_calls_total"] == 2.0 and m["multi_turn/tool_errors_total"] == 4.0
    assert m["multi_turn/tool_error_rate"] == 1.0


def test_a_tool_that_raises_is_an_answer_not_a_crash():
    async def boom(args):
        raise RuntimeError("disk on fire")

    script = lambda uid, i, turn, ctx: [call("boom"), "ok" if "disk on fire" in ctx else "?"][turn]
    ro, loop, _, sink = build(script, [Tool("boom", boom)])
    run(ro)
    r = sink.groups[0].responses[0]
    assert "Error executing tool 'boom': RuntimeError: disk on fire" in TOK.decode(r.token_ids)
    assert TOK.decode(r.token_ids).endswith("ok<|im_end|>")  # the model read the error
    assert loop.stats.metrics()["multi_turn/tool_errors_total"] == 1.0


def test_a_hanging_tool_times_out_while_other_trajectories_go_on():
    async def hang(args):
        await asyncio.sleep(3600)

    def script(uid, i, turn, ctx):
        if i == 0:
            return [call("hang"), "after the timeout"][turn]
        return "no tools needed, finished quickly"

    ro, loop, _, sink = build(script, [Tool("hang", hang)], n=2, tool_timeout_s=0.5)
    t0 = time.monotonic()
    run(ro)
    hung, quick = sink.groups[0].responses
    assert "Error executing tool 'hang': timed out after 0.5s" in TOK.decode(hung.token_ids)
    assert quick.end_time - quick.start_time < 0.4 and hung.end_time > quick.end_time
    assert time.monotonic() - t0 < 5
    m = loop.stats.metrics()
    assert m["multi_turn/tool_timeouts_total"] == 1.0 and m["multi_turn/tool_timeout_rate"] == 1.0


def test_a_hanging_sync_function_tool_times_out_too(tmp_path):
    from verl_async.tools.function_tool import FunctionTool
    from verl_async.tools.schemas import OpenAIFunctionToolSchema

    tool = FunctionTool("sleepy", lambda: time.sleep(3600), OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "sleepy", "description": "s"}}))
    ro, loop, _, sink = build(lambda u, i, t, c: [call("sleepy"), "fine"][t], [tool], tool_timeout_s=0.3)
    run(ro)
    assert "timed out after 0.3s" in TOK.decode(sink.groups[0].responses[0].token_ids)


def test_a_huge_tool_answer_is_truncated():
    async def flood(args):
        return "A" * 5000 + "Z" * 5000

    ro, _, _, sink = build(lambda u, i, t, c: [call("flood"), "ok"][t], [Tool("flood", flood)],
                           max_tool_response_length=40, tool_response_truncate_side="middle")
    run(ro)
    inserted = [text for m, text in segments(sink.groups[0].responses[0]) if m == 0][0]
    assert "\n" + "A" * 20 + "...(truncated)..." + "Z" * 20 + "<|im_end|>" in inserted


# ------------------------------------------------------------------ limits
def forever(uid, i, turn, ctx):
    return "again " + call("calculator", expression=f"{turn}+1")


def test_max_assistant_turns_ends_the_trajectory():
    ro, loop, _, sink = build(forever, [CalculatorTool({})], max_assistant_turns=3)
    run(ro)
    r = sink.groups[0].responses[0]
    assert r.agent_info["assistant_turns"] == 3 and r.agent_info["stop_reason"] == "turn_limit"
    assert r.agent_info["tool_calls"] == 2 and r.finish_reason == "stop"
    assert loop.stats.metrics()["multi_turn/ended_by_turn_limit"] == 1.0


def test_max_user_turns_ends_the_trajectory():
    ro, _, _, sink = build(forever, [CalculatorTool({})], max_user_turns=1)
    run(ro)
    assert sink.groups[0].responses[0].agent_info["assistant_turns"] == 2


@pytest.mark.parametrize("budget", [60, 95, 130])
def test_the_response_budget_counts_every_token_after_the_prompt(budget):
    ro, loop, _, sink = build(forever, [CalculatorTool({})], budget=budget)
    run(ro)
    r = sink.groups[0].responses[0]
    assert len(r) <= budget and r.finish_reason == "length"
    assert r.agent_info["stop_reason"] in ("length", "budget")
    assert r.loss_mask[-1] == 1  # it never ends on a tool answer it had no room to reply to


# ------------------------------------------------------------------ asynchrony
def test_a_sync_mid_turn_aborts_it_and_continues_it_under_the_new_weights():
    long_turn = "Now the second turn, long enough to be interrupted by the weight sync. " * 2
    script = lambda uid, i, turn, ctx: [call("calculator", expression="1+1"), long_turn][turn]
    ro, _, (engine,), sink = build(script, [CalculatorTool({})], token_delay=0.004)

    async def go():
        task = asyncio.create_task(ro.run())
        while not any(key[2] == 1 for key in engine.contexts):  # the second turn has started
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await ro.pause_for_sync()
        await ro.load_weights([("w", torch.ones(1))], 1)
        await ro.resume_after_sync(1)
        await asyncio.wait_for(task, 30)

    asyncio.run(go())
    r = sink.groups[0].responses[0]
    assert engine.aborted >= 1 and ro.counters.continued_requests >= 1
    assert TOK.decode(r.token_ids).endswith(long_turn + "<|im_end|>")  # continued exactly where it stopped
    runs = segments(r)
    assert [m for m, _ in runs] == [1, 0, 1]
    second = [k for k, m in enumerate(r.loss_mask) if m][len(TOK.encode(runs[0][1])):]
    versions = [r.versions[k] for k in second]
    switch = versions.index(1)
    assert 0 < switch < len(versions) and set(versions[:switch]) == {0} and set(versions[switch:]) == {1}
    assert all(r.versions[k] == 0 for k in range(len(TOK.encode(runs[0][1]))))
    assert r.min_version == 0 and r.max_version == 1


def test_a_sync_while_tools_run_needs_no_abort_and_the_next_turn_uses_new_weights():
    gate = asyncio.Event()

    async def waiting(args):
        await gate.wait()
        return "ready"

    ro, _, (engine,), sink = build(lambda u, i, t, c: [call("wait"), "next"][t], [Tool("wait", waiting)],
                                   partial=False)

    async def go():
        task = asyncio.create_task(ro.run())
        while not engine.contexts or ro._running_requests:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(ro.pause_for_sync(), 2)  # nothing on the engine: the sync does not wait for tools
        await ro.load_weights([("w", torch.ones(1))], 1)
        await ro.resume_after_sync(1)
        gate.set()
        await asyncio.wait_for(task, 30)

    asyncio.run(go())
    r = sink.groups[0].responses[0]
    model_versions = [v for v, m in zip(r.versions, r.loss_mask) if m]
    first_len = len(TOK.encode(call("wait"))) + 1
    assert set(model_versions[:first_len]) == {0} and set(model_versions[first_len:]) == {1}
    assert engine.aborted == 0


# ------------------------------------------------------------------ rows
def test_agent_name_rows_and_tools_kwargs():
    tool = Tool("answer", lambda args: asyncio.sleep(0, result="noted"), step_reward=0.5, final_reward=2.0)
    items = [PromptTask("multi", 0, 0, list(PROMPT), agent_name="tool_agent",
                        extra_info={"tools_kwargs": {"answer": {"create_kwargs": {"ground_truth": "42"},
                                                                "execute_kwargs": {"flag": 1}}}}),
             PromptTask("single", 1, 0, list(PROMPT), agent_name="single_turn_agent")]
    ro, _, _, sink = build(lambda u, i, t, c: [call("answer", value=42), "bye"][t], [tool], items=items)
    run(ro)
    by_uid = {g.uid: g.responses[0] for g in sink.groups}
    multi, single = by_uid["multi"], by_uid["single"]
    assert multi.agent_info["tool_rewards"] == [0.5] and multi.agent_info["rollout_reward_scores"] == {"answer": 2.0}
    assert tool.created == [{"ground_truth": "42"}] and tool.kwargs[0]["flag"] == 1
    assert tool.kwargs[0]["agent_data"] is not None
    assert single.loss_mask is None and single.agent_info == {}
    assert TOK.decode(single.token_ids) == call("answer", value=42) + "<|im_end|>"  # one turn, the call unanswered


def test_an_unknown_agent_name_stops_the_run_naming_it():
    items = [PromptTask("p0", 0, 0, list(PROMPT), agent_name="react_agent")]
    ro, _, _, _ = build(calc_then_answer, [CalculatorTool({})], items=items)
    with pytest.raises(ValueError, match=r"prompt p0: agent_name='react_agent' is not supported"):
        run(ro)
