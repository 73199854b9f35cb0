"""Start-up checks (issue 28, items 6 and 11): what would fail hours in, or after Ray started, fails in
seconds before it, in one line naming the key or the row; the dry run runs the same checks."""

from __future__ import annotations

import pytest

from verl_async.config import ConfigError, compose, validate

A = "actor_rollout_ref"


def check(*overrides: str):
    return validate(compose("fully_async_ppo_trainer", list(overrides)))


# --------------------------------------------------------------------------- token budgets (config only)
@pytest.mark.parametrize(
    "overrides,key,words",
    [
        (["data.max_prompt_length=4000", "data.max_response_length=200"], f"{A}.actor.ppo_max_token_len_per_gpu",
         "4096 tokens per update micro-batch cannot hold one sequence of up to data.max_prompt_length + "
         "data.max_response_length = 4000 + 200 = 4200 tokens"),
        (["async_training.use_rollout_log_probs=false", f"{A}.rollout.log_prob_max_token_len_per_gpu=191"],
         f"{A}.rollout.log_prob_max_token_len_per_gpu", "= 128 + 64 = 192 tokens"),
        ([f"{A}.actor.use_kl_loss=true", f"{A}.ref.log_prob_max_token_len_per_gpu=1000", "data.max_prompt_length=999",
          "data.max_response_length=2"], f"{A}.ref.log_prob_max_token_len_per_gpu", "raise it to at least 1001"),
        ([f"{A}.rollout.response_length=100"], f"{A}.actor.ppo_max_token_len_per_gpu", None),  # fits: no error
    ],
)
def test_longest_sequence_must_fit_every_token_budget_in_use(overrides, key, words):
    """The trainer packs whole sequences into micro-batches of at most the budget: a longer one fails the update."""
    if words is None:
        check(*overrides, f"{A}.actor.ppo_max_token_len_per_gpu=228")  # 128 + 100: exactly fits
        with pytest.raises(ConfigError, match=r"128 \+ 100 = 228 tokens"):
            check(*overrides, f"{A}.actor.ppo_max_token_len_per_gpu=227")
        return
    with pytest.raises(ConfigError) as info:
        check(*overrides)
    assert info.value.key == key and words in info.value.reason, str(info.value)


def test_budgets_not_in_use_are_not_checked():
    # bypass mode (no old log-prob recompute), no KL (no reference), fixed micro-batches: nothing packs by tokens
    check("data.max_prompt_length=5000", f"{A}.actor.use_dynamic_bsz=false",
          f"{A}.rollout.log_prob_max_token_len_per_gpu=10", f"{A}.ref.log_prob_max_token_len_per_gpu=10")
    check("data.max_prompt_length=5000", "debug.rollout_only=true")  # no trainer at all
