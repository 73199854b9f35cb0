"""A calculator tool: arithmetic on numbers, evaluated from the expression's syntax tree (no eval).

`+ - * / // % **`, parentheses, unary signs and a few math functions (sqrt, abs, round,
min, max, floor, ceil, log, exp). Results and intermediate values are bounded, so
`9**9**9` is refused instead of freezing the event loop. Any problem is answered to the
model as `Error: ...` (metrics `success=False`), never raised.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable, Optional

from verl_async.tools.base_tool import BaseTool
from verl_async.tools.latency import SimulatedLatency
from verl_async.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

MAX_ABS = 1e100
MAX_EXPONENT = 1000
MAX_LENGTH = 500  # characters of expression

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "floor": math.floor,
    "ceil": math.ceil, "log": math.log, "exp": math.exp,
}

CALCULATOR_SCHEMA = OpenAIFunctionToolSchema.model_validate({
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression, e.g. (12 + 7) * 3, and return the number.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The arithmetic expression."}},
            "required": ["expression"],
        },
    },
})


class CalculationError(ValueError):
    pass


def _bounded(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculationError(f"not a number: {value!r}")
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_ABS:
        raise CalculationError("result out of range")
    return value


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculationError(f"exponent {right} is too large")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculationError("division by zero") from None
        except OverflowError:
            raise CalculationError("result out of range") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_eval(node.operand)))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        try:
            return _bounded(_FUNCTIONS[node.func.id](*(_eval(a) for a in node.args)))
        except (TypeError, ValueError, OverflowError) as exc:
            raise CalculationError(f"{node.func.id}: {exc}") from None
    raise CalculationError(f"unsupported syntax: {ast.dump(node)[:60]}")


def calculate(expression: str) -> float | int:
    """The value of an arithmetic expression (CalculationError on anything else)."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculationError("empty expression")
    if len(expression) > MAX_LENGTH:
        raise CalculationError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError as exc:
        raise CalculationError(f"invalid expression ({exc.msg})") from None
    return _eval(tree)


def format_number(value: float | int) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class CalculatorTool(BaseTool):
    """config: `latency_s` (seconds or [low, high]) and `latency_seed`, for latency studies."""

    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        super().__init__(config, tool_schema or CALCULATOR_SCHEMA)
        self.latency = SimulatedLatency.from_config(self.config)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        await self.latency.wait()
        expression = parameters.get("expression", parameters.get("expr"))
        try:
            text, ok = format_number(calculate(expression)), True
        except CalculationError as exc:
            text, ok = f"Error: {exc}", False
        return ToolResponse(text=text), 0.0, {"success": ok}
