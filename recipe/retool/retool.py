"""ReTool's reward for verl's `dapo_7b_async_retool.sh` (the path it names; verl's recipe/retool, rewritten here).

`compute_score` scores the last `\\boxed{}` answer like DAPO (+1 / -1) and, as ReTool does,
softens a wrong answer's penalty for trajectories that used the interpreter more
(`extra_info["num_turns"]`, which the agent loop passes: assistant + tool turns + 1), never
above -0.6. The script's `data.custom_cls` (ReTool's dataset class) is not supported: give
`data.train_files` parquet files in verl's schema (prompt messages with the tool instructions).
"""

from __future__ import annotations

from typing import Any, Optional

from verl_async.reward import math_dapo


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> dict:
    result = dict(math_dapo.compute_score(solution_str, str(ground_truth), strict_box_verify=True))
    turns = (extra_info or {}).get("num_turns") or 1
    if result["score"] < 0:
        result["score"] = min(-0.6, result["score"] + (turns - 2) / 2 * 0.1)
    return result
