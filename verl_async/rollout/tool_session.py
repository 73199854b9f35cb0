"""One trajectory's tool calls: instances, timeouts, errors, truncation, step rewards.

A BaseTool gets one instance per trajectory, created at its first call with the row's
`extra_info.tools_kwargs[name].create_kwargs`; when the trajectory ends `close()` asks each
instance's `calc_reward` (with `calc_reward_kwargs`) and releases it (`release_kwargs`).
Function tools are stateless and just called.

Nothing a tool does stops the run: an unknown name, arguments that are no JSON object,
an exception, a non-text answer or a call over `multi_turn.tool_timeout_s` becomes an
answer to the model (verl's wording) and is counted (`ToolOutcome.status`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from verl_async.tools.function_tool import FunctionTool, normalize_function_tool_return
from verl_async.tools.schemas import ToolResponse
from verl_async.rollout.tool_parser import FunctionCall

logger = logging.getLogger(__name__)

OK, ERROR, TIMEOUT = "ok", "error", "timeout"


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

    def _kwargs(self, name: str, stage: str) -> dict:
        return dict(self.tools_kwargs.get(name, {}).get(stage) or {})

    async def call(self, call: FunctionCall) -> ToolOutcome:
        t0 = time.monotonic()
        outcome = await self._call(call)
        outcome.latency_s = time.monotonic() - t0
        if outcome.status != OK:
            logger.debug("tool call %s: %s: %s", call.name, outcome.status, outcome.text[:200])
        outcome.text = truncate_text(outcome.text, self.max_chars, self.truncate_side)
        return outcome

    async def _call(self, call: FunctionCall) -> ToolOutcome:
        name = call.name
        if name not in self.tools:
            return ToolOutcome(name, f"Unknown function '{name}'. Available tools: {sorted(self.tools)}", status=ERROR)
        if not isinstance(call.arguments, dict):
            return ToolOutcome(name, f"Invalid arguments for '{name}': expected a JSON object, got "
                                     f"{str(call.arguments)[:100]!r}", status=ERROR)
        tool = self.tools[name]
        try:
            response, reward, metrics = await asyncio.wait_for(self._execute(tool, name, call.arguments),
                                                               timeout=self.timeout_s)
        except asyncio.TimeoutError:
            return ToolOutcome(name, f"Error executing tool '{name}': timed out after {self.timeout_s:g}s",
                               status=TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - a tool's bug is the model's answer, not the run's end
            return ToolOutcome(name, f"Error executing tool '{name}': {type(exc).__name__}: {exc}", status=ERROR)
        if response.image or response.video:
            return ToolOutcome(name, f"Error executing tool '{name}': it returned images/videos; only text "
                                     "reaches the model", status=ERROR)
        return ToolOutcome(name, response.text or "", float(reward or 0.0), dict(metrics or {}))

    async def _execute(self, tool: Any, name: str, arguments: dict) -> tuple[ToolResponse, float, dict]:
        if isinstance(tool, FunctionTool):
            return normalize_function_tool_return(await tool.call(arguments))
        if name not in self.instances:
            instance_id, _ = await tool.create(create_kwargs=self._kwargs(name, "create_kwargs"))
            self.instances[name] = instance_id
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
