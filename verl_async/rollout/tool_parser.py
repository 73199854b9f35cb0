"""Tool calls in a model turn's text: `multi_turn.format` (verl's names; hermes is the one built in).

hermes (Qwen2.5, NousHermes, and most chat templates with tools):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

As in verl, a block whose JSON does not parse or lacks `name`/`arguments` is skipped (and
counted as malformed); a turn without a valid call ends the trajectory. `arguments` may be
an object or a string holding one (some models write it so); anything else reaches the
tool call as a string, and the loop answers the model that the arguments are invalid.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: Any  # a dict when it parsed, else what the model wrote


@dataclass
class ParsedTurn:
    content: str  # the turn's text without its tool-call blocks
    calls: list[FunctionCall] = field(default_factory=list)
    malformed: int = 0  # blocks that looked like a call but were not one


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls, malformed = [], 0
        for body in self._BLOCK.findall(text):
            call = self._call(body)
            if call is None:
                malformed += 1
            else:
                calls.append(call)
        closed = len(self._BLOCK.findall(text))
        malformed += max(0, text.count(self.START) - closed)  # an opened block never closed
        return ParsedTurn(self._BLOCK.sub("", text), calls, malformed)

    @staticmethod
    def _call(body: str):
        try:
            data = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or "arguments" not in data:
            return None
        arguments = data["arguments"]
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except json.JSONDecodeError:
                decoded = None
            if isinstance(decoded, dict):
                arguments = decoded
        return FunctionCall(data["name"], arguments)


PARSERS = {"hermes": HermesToolParser}  # == verl_async.config.schema_rules.TOOL_CALL_FORMATS


def tool_parser(name: str) -> HermesToolParser:
    if name not in PARSERS:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={name!r}: expected one of {sorted(PARSERS)}")
    return PARSERS[name]()
