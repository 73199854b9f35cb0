"""verl's `reward.custom_reward_function` for the side-by-side runs (issue 27): OUR scorer, so both systems score alike.

verl's default reward dispatch knows no `verl_async/arithmetic` data_source; pointed at this file
(`reward.custom_reward_function.path=scripts/device/verl_reward.py`) verl scores every response with
verl_async's own registry, with the settings our runs use (`reward_model.gsm8k_method=flexible`).
Both decode responses without special tokens before scoring.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from verl_async.reward.registry import default_compute_score  # noqa: E402

GSM8K_METHOD = os.environ.get("VERL_COMPARE_GSM8K_METHOD", "flexible")


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None,
                  **_: Any) -> dict:
    """{"score", "acc"}: verl logs `acc` as `val-core/<data_source>/acc/mean@1`."""
    options = {"method": GSM8K_METHOD} if data_source in ("openai/gsm8k", "verl_async/arithmetic") else {}
    return default_compute_score(data_source, solution_str, ground_truth, extra_info, **options)
