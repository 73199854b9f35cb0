"""Tool calls in a model turn's text: `multi_turn.format` (verl's names; hermes is the one built in).

hermes (Qwen2.5, NousHermes, and most chat templates with tools):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

A block whose JSON does not parse (however deep its nesting), lacks `name`/`arguments`, or
a `<tool_call>` never closed, is a malformed call: counted, and answered to the model as an
error (`FunctionCall.error`) like any other failed call, so the model can correct it (verl
skips such blocks; a turn holding only them ends its trajectory there). A turn without any
`<tool_call>` ends the trajectory. `arguments` may be an object or a string holding one
(some models write it so); anything else reaches the tool call as a string, and the loop
answers the model that the arguments are invalid. Nothing a model writes makes `parse` raise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

MALFORMED = "(malformed call)"  # the name of a call that has none


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: Any  # a dict when it parsed, else what the model wrote
    error: Optional[str] = None  # a malformed call: what is wrong with it (answered to the model)


@dataclass
class ParsedTurn:
    content: str  # the turn's text without its tool-call blocks
    calls: list[FunctionCall] = field(default_factory=list)
    malformed: int = 0  # blocks that looked like a call but were not one


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls = [self._call(body) for body in self._BLOCK.findall(text)]
        unclosed = max(0, text.count(self.START) - len(calls))
        calls += [FunctionCall(MALFORMED, None, f"a {self.START} block was not closed with {self.END}")] * unclosed
        return ParsedTurn(self._BLOCK.sub("", text), calls, sum(c.error is not None for c in calls))

    @staticmethod
    def _call(body: str) -> FunctionCall:
        expected = 'expected {"name": <tool name>, "arguments": {...}}'
        try:
            data = json.loads(body.strip())
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, or nesting deeper than Python recurses
            why = "nested too deeply" if isinstance(exc, RecursionError) else "not valid JSON"
            return FunctionCall(MALFORMED, None, f"the tool call is {why}; {expected}")
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or "arguments" not in data:
            return FunctionCall(MALFORMED, None, f"the tool call has no name or no arguments; {expected}")
        arguments = data["arguments"]
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except (ValueError, RecursionError):
                decoded = None
            if isinstance(decoded, dict):
                arguments = decoded
        return FunctionCall(data["name"], arguments)


PARSERS = {"hermes": HermesToolParser}  # == verl_async.config.schema_rules.TOOL_CALL_FORMATS


def tool_parser(name: str) -> HermesToolParser:
    if name not in PARSERS:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={name!r}: expected one of {sorted(PARSERS)}")
    return PARSERS[name]()
