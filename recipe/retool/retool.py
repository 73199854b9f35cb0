"""ReTool's reward and dataset class for verl's `dapo_7b_async_retool.sh` (the path it names; verl's recipe/retool,
rewritten here).

`compute_score` scores the last `\\boxed{}` answer like DAPO (+1 / -1) and, as ReTool does,
softens a wrong answer's penalty for trajectories that used the interpreter more
(`extra_info["num_turns"]`, which the agent loop passes: assistant + tool turns + 1), never
above -0.6.

`CustomSandboxFusionTool` (the class ReTool's tool config names) is verl's `SandboxFusionTool`
(verl_async/tools/sandbox_fusion_tools.py) with ReTool's changes: the code is taken out of a
```python fence, and a last line that is not a `print` is printed.

`CustomRLHFDataset` (`data.custom_cls.name`) reads the script's data as they come from the hub:
DAPO-Math-17k's rows are already in verl's schema and get the boxed-answer instruction; AIME
rows (`Problem`/`Answer` as in Maxwell-Jia/AIME_2024, `problem`/`answer` as in
yentinglin/aime_2025) become verl rows with that instruction. Every row runs the tool agent loop.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from verl_async.data import RLHFDataset
from verl_async.reward import math_dapo
from verl_async.tools.sandbox_fusion_tools import SandboxFusionTool
from verl_async.tools.schemas import ToolResponse

ANSWER_FORMAT = "\nThe answer format must be: \\boxed{'The final answer goes here.'}"
TOOL_AGENT = "tool_agent"


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> dict:
    result = dict(math_dapo.compute_score(solution_str, str(ground_truth), strict_box_verify=True))
    turns = (extra_info or {}).get("num_turns") or 1
    if result["score"] < 0:
        result["score"] = min(-0.6, result["score"] + (turns - 2) / 2 * 0.1)
    return result


_CODE_BLOCK = re.compile(r"```python(.*?)```", re.DOTALL)


def retool_code(code: str) -> str:
    """ReTool's rewrite of the model's code: the first ```python block, its last non-empty line printed."""
    matches = _CODE_BLOCK.findall(code)
    if matches:
        code = matches[0].strip()
    lines = code.split("\n")
    for i, line in reversed(list(enumerate(lines))):
        if line == "":
            continue
        if not line.startswith("print"):
            lines[i] = f"print({line})"
        break
    return "\n".join(lines)


class CustomSandboxFusionTool(SandboxFusionTool):
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code", "")
        code = retool_code(code if isinstance(code, str) else str(code))
        timeout = parameters.get("timeout", self.default_timeout)
        language = parameters.get("language", self.default_language)
        text, metrics = await self.execute_code(instance_id, code, timeout, language)
        return ToolResponse(text=text), 0.0, metrics


class CustomRLHFDataset(RLHFDataset):
    """DAPO-Math-17k and AIME rows -> verl rows whose question asks for a `\\boxed{}` answer."""

    def map_fn(self, row: dict[str, Any], *, file: str) -> Optional[dict[str, Any]]:
        if isinstance(row.get("prompt"), list):  # DAPO-Math-17k: verl's schema already
            messages = [dict(m) for m in row["prompt"]]
            if not messages:
                raise ValueError("prompt has no message")
            messages[0]["content"] = f"{messages[0]['content']}{ANSWER_FORMAT}"
            return {**row, "prompt": messages, "agent_name": TOOL_AGENT}
        problem, answer = _aime_fields(row)
        return {
            "data_source": _aime_source(file),
            "prompt": [{"role": "user", "content": f"{problem}{ANSWER_FORMAT}"}],
            "ability": "MATH",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"index": row.get("ID", row.get("id"))},
            "agent_name": TOOL_AGENT,
        }


def _aime_fields(row: dict[str, Any]) -> tuple[str, Any]:
    """(problem, answer) of an AIME row, whichever capitalisation its columns use."""
    for problem_key, answer_key in (("Problem", "Answer"), ("problem", "answer")):
        if row.get(problem_key) is not None and row.get(answer_key) is not None:
            return str(row[problem_key]), row[answer_key]
    raise ValueError(f"neither a verl row (prompt messages) nor an AIME row (problem, answer); columns: {sorted(row)}")


def _aime_source(file: str) -> str:
    """`aime_2024` for a file under .../AIME_2024/..., `aime` when the path names no year."""
    match = re.search(r"aime[_-]?(\d{4})", file, re.IGNORECASE)
    return f"aime_{match.group(1)}" if match else "aime"
