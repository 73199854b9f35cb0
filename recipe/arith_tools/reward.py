"""A reward for the arithmetic task with a tool (data_preprocess.arithmetic_tools) that pays a little for using it.

    custom_reward_function.path=recipe/arith_tools/reward.py custom_reward_function.name=compute_score

A correct final answer scores 1 (GSM8K's flexible rule: the last number); a wrong one
scores `TOOL_BONUS` if the trajectory called a tool, else 0. As ReTool's reward softens
a wrong answer's penalty for tool use, this gives a model that seldom calls the tool (a
135M one: about 1 call in 32 samples) a gradient towards calling it, without paying more
for a call than for a right answer.
"""

from __future__ import annotations

from typing import Any, Optional

from verl_async.reward import gsm8k

TOOL_BONUS = 0.1


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> dict:
    correct = gsm8k.compute_score(solution_str, str(ground_truth), method="flexible") == 1.0
    called = int((extra_info or {}).get("tool_calls", 0) or 0) > 0
    return {"score": 1.0 if correct else (TOOL_BONUS if called else 0.0), "acc": float(correct),
            "tool_used": float(called)}
