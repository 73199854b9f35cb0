"""A Python code interpreter tool: the model's code runs in the OS sandbox of verl_async/sandbox/.

Config keys (YAML `config:`), with verl's SandboxFusionTool names where one exists, so a
ReTool config ports by changing `class_name`:

* `default_timeout` (s, 10): wall-clock limit; `cpu_time_limit_s` (default: the same): CPU seconds;
* `memory_limit_mb` (1024): memory limit; `max_output_bytes` (65536): output cap;
* `rate_limit` (4): runs at the same time in this process (more wait their turn; the wait
  is not counted against `multi_turn.tool_timeout_s`);
* `allow_site_packages` (false): the code may import this environment's packages (read-only);
* `max_processes` (64), `max_file_mb` (16), `workdir_mb` (64): processes, largest file, all files;
* `isolation` (`nsjail`): the OS sandbox; where it cannot be set up the tool refuses to start
  with one line saying why. `process` runs the code WITHOUT OS isolation (a plain process
  with rlimits): an explicit opt-in, warned about at start-up;
* `default_language` ("python" only), `python_executable` (this interpreter);
* `latency_s`, `latency_seed`: an extra delay per call (latency studies).

Code in a ```python fence is taken out of it. A failed run (exception, timeout, limit)
is answered to the model with its output and an `Error: ...` line, metrics `success=False`.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

from verl_async.sandbox import IsolationUnavailable, SandboxLimits, isolation_problem, run_code
from verl_async.tools.base_tool import BaseTool
from verl_async.tools.latency import SimulatedLatency
from verl_async.tools.queueing import ToolSlots
from verl_async.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

logger = logging.getLogger(__name__)

CODE_INTERPRETER_SCHEMA = OpenAIFunctionToolSchema.model_validate({
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python code and return what it prints (the value of a last expression is printed too).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
})

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The code of the first fenced block, else the text itself."""
    match = _FENCE.search(text)
    return match.group(1) if match else text


def limits_from_config(config: dict) -> SandboxLimits:
    timeout = float(config.get("default_timeout", 10))
    return SandboxLimits(
        wall_time_s=timeout,
        cpu_time_s=max(1, int(config.get("cpu_time_limit_s", timeout))),
        memory_mb=int(config.get("memory_limit_mb", 1024)),
        max_output_bytes=int(config.get("max_output_bytes", 64 * 1024)),
        max_file_mb=int(config.get("max_file_mb", 16)),
        workdir_mb=int(config.get("workdir_mb", 64)),
        max_processes=int(config.get("max_processes", 64)),
        allow_site_packages=bool(config.get("allow_site_packages", False)),
        python_executable=str(config.get("python_executable") or ""),
        isolation=str(config.get("isolation", "nsjail")),
    )


def checked_limits(config: dict, tool_name: str) -> SandboxLimits:
    """The config's limits, refused in one line when this machine cannot isolate them (see sandbox/jail.py)."""
    limits = limits_from_config(config)
    if limits.isolation == "process":
        logger.warning("%s: `isolation: process` runs model-written code WITHOUT OS isolation (a plain process "
                       "with rlimits: it can read your files, use the network and signal your processes); "
                       "remove the key to use the sandbox (docs/sandbox.md)", tool_name)
        return limits
    problem = isolation_problem(limits)
    if problem:
        raise IsolationUnavailable(f"{tool_name}: {problem}")
    return limits


class PythonCodeTool(BaseTool):
    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        super().__init__(config, tool_schema or CODE_INTERPRETER_SCHEMA)
        language = self.config.get("default_language", "python")
        if language != "python":
            raise ValueError(f"default_language={language!r}: only python is supported")
        self.limits = checked_limits(self.config, self.name)
        self.latency = SimulatedLatency.from_config(self.config)
        self.rate_limit = max(1, int(self.config.get("rate_limit", 4)))
        self.slots = ToolSlots(self.rate_limit)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        await self.latency.wait()
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text="Error: no code given (argument 'code')"), 0.0, {"success": False}
        async with self.slots.held():
            result = await run_code(extract_code(code), self.limits)
        metrics = {"success": result.ok, "timed_out": result.timed_out, "duration_s": result.duration_s}
        return ToolResponse(text=result.message()), 0.0, metrics
