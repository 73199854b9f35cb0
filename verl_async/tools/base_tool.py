"""BaseTool: verl's tool interface, so that a verl tool ports by changing its imports.

Lifecycle in the agent loop (verl_async/rollout/agent_loop.py): one instance per tool per
trajectory, created at the trajectory's first call of that tool,

    instance_id, _ = await tool.create(create_kwargs=...)       # extra_info.tools_kwargs[name]
    response, step_reward, metrics = await tool.execute(instance_id, parameters, agent_data=...)
    ...                                                          # every further call of the tool
    reward = await tool.calc_reward(instance_id)                 # when the trajectory ends
    await tool.release(instance_id)

`parameters` is the call's JSON arguments as a dict. Step rewards and `calc_reward` reach
the reward function through `extra_info` (`tool_rewards`, `rollout_reward_scores`).
Methods are coroutines on the Rollouter's event loop: they must not block it (await I/O,
run CPU work in a thread or a process, as the built-in Python tool does).
"""

from __future__ import annotations

import logging
from typing import Any, Optional
from uuid import uuid4

from verl_async.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

logger = logging.getLogger(__name__)


class BaseTool:
    """Subclass it; build as `cls(config=..., tool_schema=...)` (tool_schema None: the class's own)."""

    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema]):
        self.config = dict(config or {})
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__}: no tool_schema given and the class defines none")
        self.name = self.tool_schema.function.name
        logger.debug("tool %s: %s", self.name, self.tool_schema.model_dump(exclude_unset=True, exclude_none=True))

    def get_openai_tool_schema(self) -> Optional[OpenAIFunctionToolSchema]:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: Optional[str] = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """A tool instance for one trajectory: (instance id, a response for the model, usually empty)."""
        return (instance_id if instance_id is not None else str(uuid4())), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        """(response for the model, step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's reward at the end of the trajectory."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Free what `create` made."""
        return None
