"""DAPO-Math scorer (verl's `math_dapo`, Minerva style): `Answer: X` on the last lines, +1 / -1.

Only the last 300 characters count (verl: the longest MATH-500 answer has 159).
`strict_box_verify` instead wants the last `\\boxed{}` to equal the ground truth verbatim.
"""

from __future__ import annotations

import re

from verl_async.reward.math_answer import extract_boxed_answer, normalize_answer

CLIP_CHARS = 300
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False) -> dict[str, float]:
    tail = solution_str[-CLIP_CHARS:]
    if strict_box_verify:
        pred = extract_boxed_answer(tail)
        correct = pred is not None and pred == str(ground_truth)
    else:
        found = _ANSWER.findall(tail)
        correct = bool(found) and normalize_answer(found[-1].split("=")[-1]) == normalize_answer(
            str(ground_truth).split("=")[-1]
        )
    return {"score": 1.0 if correct else -1.0, "acc": float(correct)}
