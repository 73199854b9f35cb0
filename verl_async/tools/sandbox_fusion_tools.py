"""verl's `SandboxFusionTool`: a code interpreter whose code runs on a SandboxFusion service.

verl's tool config works unchanged (`class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool`
is read as this class, tool_registry.py), with its keys:

* `sandbox_fusion_url` (required): the service's `.../run_code` URL: SandboxFusion, or the
  built-in server `python -m verl_async.sandbox.server` (docs/sandbox.md). The tool refuses
  to start, in one line, when nothing there runs code;
* `default_timeout` (30 s), `default_language` ("python"), `memory_limit_mb` (1024): per call;
  a call's `timeout` / `language` arguments override them, as in verl;
* `rate_limit` (10) and `num_workers` (10): calls at once (verl's global Ray rate limiter and
  its thread pool; here one limit per process, the smaller of the two); the wait for a slot is
  not counted against `multi_turn.tool_timeout_s`. `enable_global_rate_limit` is accepted.

The model reads the run's stdout + stderr when it finished, else "no stdout here" (verl's words).
"""

from __future__ import annotations

import logging
from typing import Any, Optional
from uuid import uuid4

from verl_async.sandbox.client import call_run_code, service_problem
from verl_async.tools.base_tool import BaseTool
from verl_async.tools.queueing import ToolSlots
from verl_async.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

logger = logging.getLogger(__name__)


class SandboxFusionTool(BaseTool):
    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        super().__init__(config, tool_schema)
        self.sandbox_fusion_url = str(self.config.get("sandbox_fusion_url") or "")
        if not self.sandbox_fusion_url:
            raise ValueError("config.sandbox_fusion_url is not set (the SandboxFusion service's .../run_code URL)")
        self.default_timeout = float(self.config.get("default_timeout", 30))
        self.default_language = str(self.config.get("default_language", "python"))
        self.memory_limit_mb = int(self.config.get("memory_limit_mb", 1024))
        self.concurrency = max(1, min(int(self.config.get("rate_limit", 10)), int(self.config.get("num_workers", 10))))
        problem = service_problem(self.sandbox_fusion_url, "config.sandbox_fusion_url")
        if problem:
            raise ConnectionError(problem)
        self._instance_dict: dict[str, dict] = {}
        self.slots = ToolSlots(self.concurrency)

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                     **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id if instance_id is not None else str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code", "")
        timeout = parameters.get("timeout", self.default_timeout)
        language = parameters.get("language", self.default_language)
        if not isinstance(code, str):
            code = str(code)
        text, metrics = await self.execute_code(instance_id, code, timeout, language)
        return ToolResponse(text=text), 0.0, metrics

    async def execute_code(self, instance_id: str, code: str, timeout: Any = 30, language: str = "python") -> tuple[str, dict]:
        """(what the model reads, metrics) for one run on the service."""
        try:
            timeout = float(timeout)
        except (TypeError, ValueError):
            timeout = self.default_timeout
        async with self.slots.held():
            response, error = await call_run_code(self.sandbox_fusion_url, code, run_timeout=timeout,
                                                  compile_timeout=timeout, memory_limit_mb=self.memory_limit_mb,
                                                  language=str(language))
        if error is not None:
            logger.warning("%s: the SandboxFusion call failed: %s", self.name, error)
        run = (response or {}).get("run_result") or {}
        if run.get("status") == "Finished":
            text = (run.get("stdout") or "") + (run.get("stderr") or "")
        else:
            text = "no stdout here"
        metrics = {"success": response is not None and response.get("status") == "Success",
                   "run_status": str(run.get("status") or (response or {}).get("status") or "api_error")}
        return text, metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return float(self._instance_dict.get(instance_id, {}).get("reward") or 0.0)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instance_dict.pop(instance_id, None)
