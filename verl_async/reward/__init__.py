"""Rule-based rewards: scorers (gsm8k, MATH, DAPO-math, the built-in task), dispatch by
`data_source`, custom scorers by file path, and the `naive` / `dapo` reward managers.

Typical use (the Rollouter):

    manager = build_reward_manager(cfg.reward_model, cfg.custom_reward_function, tokenizer,
                                   max_response_length=cfg.data.max_response_length)
    for reward, info, error in manager.score_group(response_ids, data_source, ground_truth, extra_info): ...

`error` is None when the scorer scored; otherwise why it failed (the response scored 0).
A function that fails too often raises `RewardFunctionError` (reward_model.max_error_rate).
"""

from verl_async.reward.error_rate import RewardFunctionError
from verl_async.reward.manager import (
    REWARD_MANAGERS,
    OverlongBuffer,
    Reward,
    RewardManager,
    RewardStats,
    build_reward_manager,
)
from verl_async.reward.registry import (
    FunctionRef,
    UnknownDataSourceError,
    custom_scorer_ref,
    as_number,
    default_compute_score,
    resolve_scorer,
    to_score_dict,
)

__all__ = [
    "REWARD_MANAGERS",
    "FunctionRef",
    "OverlongBuffer",
    "Reward",
    "RewardFunctionError",
    "RewardManager",
    "RewardStats",
    "UnknownDataSourceError",
    "as_number",
    "build_reward_manager",
    "custom_scorer_ref",
    "default_compute_score",
    "resolve_scorer",
    "to_score_dict",
]
