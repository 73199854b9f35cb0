"""Tools for multi-turn rollouts, with verl's interface (`verl.tools`).

    from verl_async.tools import BaseTool, ToolResponse, OpenAIFunctionToolSchema, function_tool

The module names mirror verl's (`base_tool`, `schemas`, `function_tool`, `tool_registry`), so
a verl tool ports by replacing `verl.tools` with `verl_async.tools` in its imports. Built-in
tools: `calculator.CalculatorTool`, `python_tool.PythonCodeTool` (an interpreter whose code runs
in the OS sandbox, verl_async/sandbox/) and verl's `sandbox_fusion_tools.SandboxFusionTool` (the
code runs on a SandboxFusion service; verl's class path names it too).
"""

from verl_async.tools.base_tool import BaseTool
from verl_async.tools.function_tool import FunctionTool, function_tool, normalize_function_tool_return
from verl_async.tools.schemas import (
    OpenAIFunctionCallSchema,
    OpenAIFunctionParsedSchema,
    OpenAIFunctionToolCall,
    OpenAIFunctionToolSchema,
    ToolResponse,
)
from verl_async.tools.tool_registry import ToolLoadError, load_all_tools, tool_names

__all__ = [
    "BaseTool",
    "FunctionTool",
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionToolCall",
    "OpenAIFunctionToolSchema",
    "ToolLoadError",
    "ToolResponse",
    "function_tool",
    "load_all_tools",
    "normalize_function_tool_return",
    "tool_names",
]
