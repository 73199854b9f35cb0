"""verl's tool interface: a verl tool ported by its imports, tool-config YAML, function tools, the calculator."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time

import pytest

from verl_async.tools import BaseTool, ToolLoadError, ToolResponse, function_tool, load_all_tools, tool_names
from verl_async.tools.calculator import CalculatorTool, calculate
from verl_async.tools.function_tool import FUNCTION_TOOL_REGISTRY, normalize_function_tool_return
from verl_async.tools.latency import SimulatedLatency
from verl_async.tools.schemas import OpenAIFunctionToolSchema

# A tool as a verl user writes it (verl's gsm8k demo tool, shape only), imports changed to verl_async.
VERL_STYLE_TOOL = '''
from typing import Any, Optional
from uuid import uuid4

from verl_async.tools.base_tool import BaseTool
from verl_async.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class AnswerTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        create_kwargs = kwargs.get("create_kwargs", {})
        self._instance_dict[instance_id] = {"answer": None, "ground_truth": create_kwargs.get("ground_truth")}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        self._instance_dict[instance_id]["answer"] = str(parameters.get("answer", ""))
        reward = await self.calc_reward(instance_id)
        return ToolResponse(text=f"answer={parameters.get('answer')}"), (0.0 if reward else -0.05), {"bonus": self.config["bonus"]}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return 1.0 if state["answer"] == state["ground_truth"] else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
'''

ANSWER_SCHEMA = """
      tool_schema:
        type: function
        function:
          name: submit_answer
          description: Submit the final answer.
          parameters:
            type: object
            properties:
              answer: {type: string, description: The answer.}
            required: [answer]
"""


@pytest.fixture
def tool_module(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(VERL_STYLE_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_tools"
    sys.modules.pop("my_tools", None)


def write_config(tmp_path, body: str, name: str = "tools.yaml") -> str:
    path = tmp_path / name
    path.write_text("tools:\n" + textwrap.indent(textwrap.dedent(body), "  "))
    return str(path)


def test_a_verl_tool_loads_from_a_tool_config_and_runs_its_lifecycle(tmp_path, tool_module):
    path = write_config(tmp_path, f"""
    - class_name: {tool_module}.AnswerTool
      config: {{type: native, bonus: 2}}
    """ + ANSWER_SCHEMA)
    tools = load_all_tools(path, None)
    tool = tools["submit_answer"]
    assert isinstance(tool, BaseTool) and tool.config == {"type": "native", "bonus": 2}

    async def lifecycle():
        iid, created = await tool.create(create_kwargs={"ground_truth": "42"})
        first = await tool.execute(iid, {"answer": "41"})
        second = await tool.execute(iid, {"answer": "42"})
        reward = await tool.calc_reward(iid)
        await tool.release(iid)
        return created, first, second, reward, tool._instance_dict

    created, first, second, reward, left = asyncio.run(lifecycle())
    assert created.is_empty()
    assert first == (ToolResponse(text="answer=41"), -0.05, {"bonus": 2})
    assert second[0].text == "answer=42" and second[1] == 0.0
    assert reward == 1.0 and left == {}


def test_the_builtin_tools_bring_their_own_schema(tmp_path):
    path = write_config(tmp_path, """
    - class_name: verl_async.tools.calculator.CalculatorTool
      config: {type: native}
    - class_name: verl_async.tools.python_tool.PythonCodeTool
      config: {type: native, default_timeout: 5}
    """)
    assert tool_names(path, None) == ["calculator", "code_interpreter"]
    tools = load_all_tools(path, None)
    assert tools["code_interpreter"].limits.wall_time_s == 5.0


FUNCTION_TOOLS = '''
from verl_async.tools import function_tool


@function_tool
def add_numbers(a: int, b: float = 1.0) -> str:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)


@function_tool("shout")
async def make_loud(text: str) -> str:
    """Upper-case a text.

    Args:
        text: What to shout.
    """
    return text.upper()
'''


@pytest.fixture
def function_file(tmp_path):
    path = tmp_path / "fn_tools.py"
    path.write_text(FUNCTION_TOOLS)
    yield str(path)
    for name in ("add_numbers", "shout"):
        FUNCTION_TOOL_REGISTRY.pop(name, None)


def test_function_tools_get_their_schema_from_signature_and_docstring(function_file):
    tools = load_all_tools(None, function_file)
    assert sorted(tools) == ["add_numbers", "shout"]
    schema = tools["add_numbers"].tool_schema.model_dump(exclude_none=True)
    assert schema["function"]["description"] == "Add two numbers."
    assert schema["function"]["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "The first number."},
        "b": {"type": "number", "description": "The second number."},
    }
    assert schema["function"]["parameters"]["required"] == ["a"]
    assert asyncio.run(tools["add_numbers"].call({"a": 2, "b": 0.5})) == "2.5"
    assert asyncio.run(tools["shout"].call({"text": "hi"})) == "HI"
    assert load_all_tools(None, function_file)["shout"] is tools["shout"]  # the file runs once per process


def test_function_tool_without_docstring_or_with_varargs_is_refused():
    with pytest.raises(Exception, match="docstring|description"):
        @function_tool
        def undocumented(a: int) -> int:
            return a

    with pytest.raises(ValueError, match=r"\*args/\*\*kwargs"):
        @function_tool
        def variadic(*values: int) -> int:
            """Sum.

            Args:
                values: numbers.
            """
            return sum(values)


@pytest.mark.parametrize("ret, expected", [
    ("text", ("text", 0.0, {})),
    ({"a": 1}, ('{"a": 1}', 0.0, {})),
    (("ok", 0.5), ("ok", 0.5, {})),
    (("ok", None, {"m": 1}), ("ok", 0.0, {"m": 1})),
    (ToolResponse(text="r"), ("r", 0.0, {})),
    (7, ("7", 0.0, {})),
])
def test_function_tool_returns_are_normalised(ret, expected):
    response, reward, metrics = normalize_function_tool_return(ret)
    assert (response.text, reward, metrics) == expected


def test_function_tool_tuple_of_four_is_an_error():
    with pytest.raises(TypeError, match="4 items"):
        normalize_function_tool_return(("a", 1, {}, "extra"))


def test_a_hung_sync_function_tool_can_be_abandoned():
    """The agent loop's timeout cancels the await; the daemon thread is left behind, nothing blocks."""
    from verl_async.tools.function_tool import FunctionTool, run_in_daemon_thread

    tool = FunctionTool("sleepy", lambda: time.sleep(3600), OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "sleepy", "description": "sleeps"}}))

    async def go():
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(tool.call({}), 0.2)
        return time.monotonic() - t0, await run_in_daemon_thread(lambda x: x + 1, 1)

    waited, other = asyncio.run(go())
    assert waited < 1.0 and other == 2


# ------------------------------------------------------------------ load errors name the key and the file
def test_missing_tool_config_names_the_key_and_file(tmp_path):
    with pytest.raises(ToolLoadError) as err:
        tool_names(str(tmp_path / "nope.yaml"), None)
    assert err.value.key == "tool_config_path" and "nope.yaml" in err.value.reason


def test_unknown_tool_class_names_the_entry(tmp_path):
    path = write_config(tmp_path, """
    - class_name: verl_async.tools.calculator.CalculatorTool
    - class_name: recipe.retool.retool.NoSuchTool
      config: {type: native}
    """)
    with pytest.raises(ToolLoadError, match=r"tools\.yaml: tools\[1\]\.class_name: unknown tool class "
                                            r"'recipe\.retool\.retool\.NoSuchTool'"):
        tool_names(path, None)


def test_unsupported_tool_type_and_bad_schema_are_named(tmp_path):
    mcp = write_config(tmp_path, """
    - class_name: verl_async.tools.calculator.CalculatorTool
      config: {type: mcp}
    """, "mcp.yaml")
    with pytest.raises(ToolLoadError, match=r"tools\[0\]\.config\.type: 'mcp' is not supported"):
        tool_names(mcp, None)
    bad = write_config(tmp_path, """
    - class_name: verl_async.tools.calculator.CalculatorTool
      tool_schema: {type: function, function: {description: no name}}
    """, "bad.yaml")
    with pytest.raises(ToolLoadError, match=r"tools\[0\]\.tool_schema: not an OpenAI function schema"):
        tool_names(bad, None)


def test_duplicate_tool_names_are_refused_within_and_across_sources(tmp_path, function_file):
    twice = write_config(tmp_path, """
    - class_name: verl_async.tools.calculator.CalculatorTool
    - class_name: verl_async.tools.calculator.CalculatorTool
    """, "twice.yaml")
    with pytest.raises(ToolLoadError, match=r"duplicate tool name 'calculator': .*tools\[0\] and .*tools\[1\]"):
        tool_names(twice, None)
    clash = write_config(tmp_path, """
    - class_name: verl_async.tools.calculator.CalculatorTool
      tool_schema:
        type: function
        function: {name: shout, description: clash}
    """, "clash.yaml")
    with pytest.raises(ToolLoadError) as err:
        load_all_tools(clash, function_file)
    assert err.value.key == "function_tool_path" and "duplicate tool name 'shout'" in err.value.reason
    assert "clash.yaml: tools[0]" in err.value.reason and "fn_tools.py" in err.value.reason


def test_a_function_file_that_fails_to_import_is_named(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ToolLoadError, match=r"function_tool_path: .*broken\.py: failed to load \(ModuleNotFoundError"):
        tool_names(None, str(path))


# ------------------------------------------------------------------ calculator, latency
@pytest.mark.parametrize("expr, value", [("(12 + 7) * 3", 57), ("7 / 2", 3.5), ("2^10", 1024), ("-3 + sqrt(16)", 1.0),
                                         ("17 // 5 + 17 % 5", 5), ("max(3, 8) - min(1, 2)", 7)])
def test_calculator_values(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr, words", [("1/0", "division by zero"), ("9**9**9", "too large"),
                                         ("__import__('os')", "unsupported"), ("2 +", "invalid expression"),
                                         ("", "empty"), ("10**99 * 10**5", "out of range")])
def test_calculator_answers_errors_to_the_model(expr, words):
    response, reward, metrics = asyncio.run(CalculatorTool({}).execute("i", {"expression": expr}))
    assert response.text.startswith("Error:") and words in response.text
    assert metrics == {"success": False} and reward == 0.0


def test_configured_latency_delays_each_call():
    assert SimulatedLatency.from_config({}).draw() == 0.0
    lat = SimulatedLatency.from_config({"latency_s": [0.5, 2.0], "latency_seed": 3})
    draws = [lat.draw() for _ in range(200)]
    assert 0.5 <= min(draws) < 0.6 and 1.9 < max(draws) <= 2.0
    tool = CalculatorTool({"latency_s": 0.2})
    t0 = time.monotonic()
    response, _, _ = asyncio.run(tool.execute("i", {"expression": "1+1"}))
    assert response.text == "2" and time.monotonic() - t0 >= 0.2
    with pytest.raises(ValueError, match="latency_s"):
        SimulatedLatency.from_config({"latency_s": [2.0, 1.0]})
