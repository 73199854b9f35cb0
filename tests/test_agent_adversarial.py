"""Crashes 5-9 of issue 36: a model's output or a tool's behaviour that stopped the agent loop or the run.

Each test drives the Rollouter with the scripted engine (tests/agent_fakes.py) writing what a
model wrote, and checks that the group is still delivered, the bad call is answered to the
model and counted, and nothing keeps running after the call.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from tests.agent_fakes import call
from tests.test_agent_loop import TOK, Tool, build, run, segments
from verl_async.tools.calculator import CalculatorTool


def answers(response) -> str:
    return "".join(text for m, text in segments(response) if m == 0)


def test_5_a_tool_name_with_a_lone_surrogate_is_an_answered_error():
    bad = '<tool_call>{"name": "\\udc80calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    ro, loop, _, sink = build(lambda u, i, t, c: [bad, "done"][t], [CalculatorTool({})])
    run(ro)
    assert len(sink.groups) == 1
    text = answers(sink.groups[0].responses[0])
    assert "Unknown function" in text and "calculator']" in text
    assert loop.stats.metrics()["multi_turn/tool_errors_total"] == 1.0


@pytest.mark.parametrize("bad", [
    "<tool_call>" + "[" * 1000 + "</tool_call>",
    '<tool_call>{"name": "calculator", "arguments": "' + "[" * 1000 + '"}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": ' + '{"a": ' * 1000 + "1" + "}" * 1001 + "</tool_call>",
])
def test_6_deeply_nested_json_is_an_answered_malformed_call(bad):
    ro, loop, _, sink = build(lambda u, i, t, c: [bad, "done"][t], [CalculatorTool({})], budget=8000,
                              token_delay=0.0)
    run(ro)
    assert len(sink.groups) == 1
    text = answers(sink.groups[0].responses[0])
    assert "Error: the tool call is nested too deeply" in text or "Invalid arguments for 'calculator'" in text
    m = loop.stats.metrics()
    assert m["multi_turn/tool_errors_total"] == 1.0


def test_7_parallel_calls_of_one_tool_share_one_instance():
    class SlowCreate(Tool):
        async def create(self, instance_id=None, **kwargs):
            await asyncio.sleep(0.05)  # a create that awaits: both calls reach it before either returns
            return await super().create(instance_id, **kwargs)

    async def echo(args):
        return args["x"]

    tool = SlowCreate("echo", echo, final_reward=0.5)
    script = lambda u, i, t, c: [call("echo", x=1) + call("echo", x=2), "done"][t]
    ro, _, _, sink = build(script, [tool], max_parallel_calls=2)
    run(ro)
    assert len(tool.created) == 1 and tool.released == ["inst1"]
    assert sink.groups[0].responses[0].agent_info["rollout_reward_scores"] == {"echo": 0.5}


def _tool_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"tool-{name}" and t.is_alive()]


def test_8_timed_out_function_tools_are_stopped_and_their_count_is_bounded():
    from verl_async.tools.function_tool import FunctionTool
    from verl_async.tools.schemas import OpenAIFunctionToolSchema

    def spin():
        while True:
            pass

    schema = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {"name": "spin",
                                                                                        "description": "s"}})
    tool = FunctionTool("spin", spin, schema)
    ro, loop, _, sink = build(lambda u, i, t, c: [call("spin"), "fine"][t], [tool], n=8, tool_timeout_s=0.3)
    t0 = time.monotonic()
    run(ro)
    assert len(sink.groups) == 1 and time.monotonic() - t0 < 10
    deadline = time.monotonic() + 3
    while _tool_threads("spin") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _tool_threads("spin"), "timed-out function tools still spin"
    assert loop.stats.metrics()["multi_turn/tool_timeouts_total"] == 8.0


def test_8_function_tools_that_cannot_be_stopped_hold_a_bounded_number_of_threads():
    from verl_async.tools.function_tool import MAX_RUNNING_FUNCTION_CALLS, FunctionTool
    from verl_async.tools.schemas import OpenAIFunctionToolSchema

    release = threading.Event()
    schema = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {"name": "stuck",
                                                                                        "description": "s"}})
    tool = FunctionTool("stuck", lambda: release.wait(30), schema)  # a C-level wait: no exception reaches it
    ro, loop, _, sink = build(lambda u, i, t, c: [call("stuck"), "fine"][t], [tool], n=4, prompts=8,
                              tool_timeout_s=0.2)
    try:
        run(ro, timeout=60)
        assert len(sink.groups) == 8
        assert len(_tool_threads("stuck")) <= MAX_RUNNING_FUNCTION_CALLS
    finally:
        release.set()
    m = loop.stats.metrics()
    assert m["multi_turn/tool_timeouts_total"] + m["multi_turn/tool_errors_total"] == 32.0


def test_9_waiting_for_a_rate_limit_slot_is_not_the_snippets_time():
    try:
        from verl_async.sandbox import isolation_problem
        problem = isolation_problem()
    except ImportError:
        problem = None
    if problem and not os.environ.get("CI"):
        pytest.skip(f"no OS sandbox on this machine: {problem}")
    from verl_async.tools.python_tool import PythonCodeTool

    tool = PythonCodeTool({"rate_limit": 1, "default_timeout": 5})
    snippet = "import time\ntime.sleep(1.0)\nprint('slept')"
    script = lambda u, i, t, c: [call("code_interpreter", code=snippet) * 3, "done"][t]
    ro, loop, _, sink = build(script, [tool], max_parallel_calls=3, tool_timeout_s=2.5, budget=2000)
    run(ro, timeout=60)
    text = answers(sink.groups[0].responses[0])
    assert text.count("slept") == 3 and "timed out" not in text
    assert loop.stats.metrics()["multi_turn/tool_timeouts_total"] == 0.0
