"""A scripted engine for the multi-turn tests: the tiny model will not call tools, this one does.

`ScriptedToolEngine` plays responses written in advance, turn by turn: `script(uid, i, turn,
context)` returns the text of model turn `turn` of response `i` (the context is the
prompt and everything so far, decoded, so a script can react to a tool's answer). The
text is emitted token by token (the byte-level tiny tokenizer) with a delay, ends with
EOS, carries the engine's weight version per token, and can be aborted and continued
like a real engine's request: a continued turn resumes exactly where it stopped.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from tests.fakes import FakeEngine
from verl_async.rollout.engine import GenerateRequest, GenerateResult
from verl_async.rollout.scripted import parse_request_id

Script = Callable[[str, int, int, str], str]


class ScriptedToolEngine(FakeEngine):
    """FakeEngine's abort, pause and weight versions; its own (scripted) generation."""

    def __init__(self, tokenizer, script: Script, *, token_delay: float = 0.001, log_prob: float = -0.25) -> None:
        super().__init__(token_delay=token_delay)
        self.tokenizer = tokenizer
        self.script = script
        self.log_prob = log_prob
        self._turns: dict[tuple, dict] = {}  # (uid, i) -> {"turn", "start", "open", "target"}
        self.contexts: dict[tuple, str] = {}  # (uid, i, turn) -> decoded prompt + prefix when the turn started
        self.requests: list[GenerateRequest] = []
        self.aborted = 0

    def _turn(self, key: tuple, request: GenerateRequest) -> dict:
        prefix = len(request.prefix_token_ids)
        state = self._turns.get(key)
        if state is None or prefix == 0:
            state = {"turn": 0, "start": 0, "open": False}
        if not state["open"]:  # a new turn starts at this prefix
            turn = 0 if prefix == 0 else state["turn"] + 1
            context = self.tokenizer.decode(list(request.prompt_ids) + list(request.prefix_token_ids))
            self.contexts[key + (turn,)] = context
            text = self.script(key[0], key[1], turn, context)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.tokenizer.eos_token_id]
            state = {"turn": turn, "start": prefix, "open": True, "target": ids}
            self._turns[key] = state
        return state

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        key = parse_request_id(request.request_id) or (request.request_id, 0)
        state = self._turn(key, request)
        tokens, logps, versions = list(request.prefix_token_ids), list(request.prefix_log_probs), list(request.prefix_versions)
        todo = state["target"][len(tokens) - state["start"]:]
        abort = asyncio.Event()
        self._running[request.request_id] = abort
        reason = "stop"
        try:
            for token in todo:
                if len(tokens) >= request.sampling.max_tokens:
                    reason = "length"
                    break
                await self._paused.wait()
                await asyncio.sleep(self.token_delay)
                if abort.is_set():
                    reason = "abort"
                    self.aborted += 1
                    break
                tokens.append(token)
                logps.append(self.log_prob)
                versions.append(self._version)
        finally:
            self._running.pop(request.request_id, None)
        if reason != "abort":
            state["open"] = False
        return GenerateResult(request.request_id, tokens, logps, versions, reason)


def call(name: str, **arguments) -> str:
    """A hermes tool call as a model writes it."""
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'
