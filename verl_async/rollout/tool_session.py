"""One trajectory's tool calls: instances, timeouts, errors, truncation, step rewards.

A BaseTool gets one instance per trajectory, created at its first call with the row's
`extra_info.tools_kwargs[name].create_kwargs` (parallel calls of the tool wait for that one
creation); when the trajectory ends `close()` asks each instance's `calc_reward` (with
`calc_reward_kwargs`) and releases it (`release_kwargs`). Function tools are stateless and
just called.

Nothing a model writes or a tool does stops the run: a malformed call, an unknown name,
arguments that are no JSON object, an exception, a non-text answer or a call over
`multi_turn.tool_timeout_s` becomes an answer to the model (verl's wording) and is counted
(`ToolOutcome.status`). Answers are made valid Unicode before the tokenizer sees them (a
model can write a lone surrogate in JSON: `"\\udc80"`). `tool_timeout_s` counts a call's
running time only: time it waits for a slot of a rate-limited tool (tools/queueing.py) is
not counted, up to `QUEUE_FACTOR x tool_timeout_s`, after which the call is answered that
the tool is busy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from verl_async.rollout.tool_parser import FunctionCall
from verl_async.tools.function_tool import FunctionTool, normalize_function_tool_return
from verl_async.tools.queueing import CallClock, set_clock
from verl_async.tools.schemas import ToolResponse

logger = logging.getLogger(__name__)

OK, ERROR, TIMEOUT = "ok", "error", "timeout"
QUEUE_FACTOR = 10.0  # a call may wait this many tool_timeout_s for a slot before it is answered "busy"
CANCEL_WAIT_S = 5.0  # how long a timed-out call may take to unwind after it is cancelled


def valid_text(text: str) -> str:
    """`text` as valid Unicode: lone surrogates (from JSON escapes a model wrote) become U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")


@dataclass
class ToolOutcome:
    name: str
    text: str
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    status: str = OK  # ok | error (the tool failed or was misused) | timeout
    latency_s: float = 0.0

    @property
    def success(self) -> bool:
        """The call ran and the tool did not report a failure (metrics `success=False`)."""
        return self.status == OK and bool(self.metrics.get("success", True))


def truncate_text(text: str, limit: int, side: str) -> str:
    """verl's tool-answer truncation: `left` keeps the end, `right` the start, `middle` both ends."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:]


class ToolBusy(Exception):
    """A call waited too long for a slot of a rate-limited tool."""


class ToolSession:
    def __init__(self, tools: Mapping[str, Any], tools_kwargs: Optional[Mapping[str, Any]], *, timeout_s: float,
                 max_response_chars: int, truncate_side: str, agent_data: Any = None) -> None:
        self.tools = tools
        self.tools_kwargs = {k: dict(v or {}) for k, v in (tools_kwargs or {}).items()}
        self.timeout_s = timeout_s
        self.max_chars = max_response_chars
        self.truncate_side = truncate_side
        self.agent_data = agent_data
        self.instances: dict[str, str] = {}  # tool name -> instance id
        self._creating: dict[str, asyncio.Lock] = {}  # one creation per tool, however many parallel calls

    def _kwargs(self, name: str, stage: str) -> dict:
        return dict(self.tools_kwargs.get(name, {}).get(stage) or {})

    async def call(self, call: FunctionCall) -> ToolOutcome:
        t0 = time.monotonic()
        outcome = await self._call(call)
        outcome.latency_s = time.monotonic() - t0
        outcome.name = valid_text(outcome.name)
        if outcome.status != OK:
            logger.debug("tool call %s: %s: %s", outcome.name, outcome.status, valid_text(outcome.text[:200]))
        outcome.text = valid_text(truncate_text(outcome.text, self.max_chars, self.truncate_side))
        return outcome

    async def _call(self, call: FunctionCall) -> ToolOutcome:
        name = call.name
        if call.error is not None:
            return ToolOutcome(name, f"Error: {call.error}", status=ERROR)
        if name not in self.tools:
            return ToolOutcome(name, f"Unknown function '{name[:100]}'. Available tools: {sorted(self.tools)}",
                               status=ERROR)
        if not isinstance(call.arguments, dict):
            return ToolOutcome(name, f"Invalid arguments for '{name}': expected a JSON object, got "
                                     f"{str(call.arguments)[:100]!r}", status=ERROR)
        tool = self.tools[name]
        try:
            response, reward, metrics = await self._timed(self._execute(tool, name, call.arguments))
        except asyncio.TimeoutError:
            return ToolOutcome(name, f"Error executing tool '{name}': timed out after {self.timeout_s:g}s",
                               status=TIMEOUT)
        except ToolBusy as exc:
            return ToolOutcome(name, f"Error executing tool '{name}': {exc}", status=ERROR)
        except Exception as exc:  # noqa: BLE001 - a tool's bug is the model's answer, not the run's end
            return ToolOutcome(name, f"Error executing tool '{name}': {type(exc).__name__}: {exc}", status=ERROR)
        if response.image or response.video:
            return ToolOutcome(name, f"Error executing tool '{name}': it returned images/videos; only text "
                                     "reaches the model", status=ERROR)
        return ToolOutcome(name, response.text or "", float(reward or 0.0), dict(metrics or {}))

    async def _timed(self, work: Any) -> Any:
        """`await work` with `timeout_s` of running time (tools/queueing.py): TimeoutError, or ToolBusy when
        it waited for a slot longer than QUEUE_FACTOR x timeout_s. A timed-out call is cancelled and unwound."""
        clock = CallClock()

        async def run() -> Any:
            set_clock(clock)
            return await work

        task = asyncio.ensure_future(run())
        try:
            while True:
                remaining = self.timeout_s - clock.running()
                if clock.queued_total() > QUEUE_FACTOR * self.timeout_s:
                    raise ToolBusy(f"the tool is busy: no free slot after {clock.queued_total():.0f}s")
                if remaining <= 0:
                    raise asyncio.TimeoutError()
                done, _ = await asyncio.wait({task}, timeout=remaining if not clock.waiting else
                                             min(remaining, QUEUE_FACTOR * self.timeout_s - clock.queued_total()))
                if done:
                    return task.result()
        except BaseException:
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
            raise

    async def _instance(self, tool: Any, name: str) -> str:
        async with self._creating.setdefault(name, asyncio.Lock()):
            if name not in self.instances:
                instance_id, _ = await tool.create(create_kwargs=self._kwargs(name, "create_kwargs"))
                self.instances[name] = instance_id
        return self.instances[name]

    async def _execute(self, tool: Any, name: str, arguments: dict) -> tuple[ToolResponse, float, dict]:
        if isinstance(tool, FunctionTool):
            return normalize_function_tool_return(await tool.call(arguments))
        await self._instance(tool, name)
        response, reward, metrics = await tool.execute(self.instances[name], arguments, agent_data=self.agent_data,
                                                       **self._kwargs(name, "execute_kwargs"))
        if not isinstance(response, ToolResponse):  # verl's older tools return plain text
            response = ToolResponse(text=str(response))
        return response, reward, metrics

    async def close(self) -> dict[str, float]:
        """calc_reward and release every instance; tool name -> reward (a failing tool: left out, logged)."""
        rewards: dict[str, float] = {}
        for name, instance_id in list(self.instances.items()):
            tool = self.tools[name]
            try:
                value = await asyncio.wait_for(tool.calc_reward(instance_id, **self._kwargs(name, "calc_reward_kwargs")),
                                               timeout=self.timeout_s)
                rewards[name] = float(value)
            except Exception as exc:  # noqa: BLE001 - also TimeoutError
                logger.warning("tool %s: calc_reward failed (%s: %s); its reward is left out", name,
                               type(exc).__name__, exc)
            try:
                await asyncio.wait_for(tool.release(instance_id, **self._kwargs(name, "release_kwargs")),
                                       timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001
                logger.warning("tool %s: release failed (%s: %s)", name, type(exc).__name__, exc)
        self.instances.clear()
        return rewards
