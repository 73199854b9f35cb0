"""GSM8K scorer with verl's semantics (verl.utils.reward_score.gsm8k).

`strict` wants the GSM8K format `#### <number>` (it also rewards following the
instruction); `flexible` takes the last number anywhere. Only the last 300
characters are searched: the answer sits at the end, and a regex over a 10 MB
response must stay cheap. The comparison is verl's plain string equality after
removing `,` and `$`; the preprocessor already stores ground truths that way.

One deliberate difference from verl: `flexible` normalises the number it finds the way
`strict` does (commas removed) and drops a trailing period, so "The answer is 12." and
"1,200" count; verl compares "12." / "1,200" with the ground truth and scores 0.
"""

from __future__ import annotations

import re
from typing import Optional

CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
METHODS = ("strict", "flexible")


def extract_solution(solution_str: str, method: str = "strict") -> Optional[str]:
    """The answer the response commits to, or None when it gives none."""
    if method not in METHODS:
        raise ValueError(f"gsm8k: method must be one of {METHODS}, got {method!r}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_NUMBER.findall(tail)):
        if candidate not in ("", "."):
            return candidate.replace(",", "").rstrip(".")
    return None


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` for the right answer, `format_score` for a wrong one, 0 when none is found (verl)."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth) else float(format_score)
