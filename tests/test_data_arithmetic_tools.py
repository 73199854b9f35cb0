"""data_preprocess.arithmetic_tools: the arithmetic rows with a few-shot tool prompt and verl's agent_name."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest

from data_preprocess import arithmetic, arithmetic_tools
from verl_async.rollout.tool_parser import tool_parser


@pytest.mark.parametrize("tool, arguments", [("calculator", {"expression": "4 * 6"}),
                                             ("code_interpreter", {"code": "print(4 * 6)"})])
def test_rows_show_one_call_in_the_tools_format(tmp_path, tool, arguments):
    written = arithmetic_tools.main(["--local_dir", str(tmp_path), "--tool", tool, "--train_size", "8",
                                     "--test_size", "3"])
    rows = pq.read_table(written["train"]).to_pylist()
    plain = arithmetic.generate_splits(8, 3, 0)["train"]
    assert len(rows) == 8 and all(r["agent_name"] == "tool_agent" for r in rows)
    for row, base in zip(rows, plain):
        system, user = row["prompt"]
        assert system["role"] == "system" and user == base["prompt"][0]
        assert row["reward_model"] == base["reward_model"]
    calls = tool_parser("hermes").parse(rows[0]["prompt"][0]["content"]).calls
    assert len(calls) == 2 and all(c.name == tool and c.arguments == arguments for c in calls)  # the format, the example
    assert re.search(r"#### 24$", rows[0]["prompt"][0]["content"])
    assert json.loads(arithmetic_tools._EXAMPLE_CALL[tool])["name"] == tool
    assert len(pq.read_table(written["test"]).to_pylist()) == 3


def test_the_tool_use_reward_pays_a_little_for_a_call_and_all_for_the_answer():
    from recipe.arith_tools.reward import TOOL_BONUS, compute_score

    text = "<tool_call>{...}</tool_call>\ntool\n42\nassistant\nTom has 42 apples.\n#### 42"
    assert compute_score("verl_async/arithmetic", text, "42", {"tool_calls": 1})["score"] == 1.0
    assert compute_score("verl_async/arithmetic", "#### 41", "42", {"tool_calls": 2})["score"] == TOOL_BONUS
    assert compute_score("verl_async/arithmetic", "#### 41", "42", {"num_turns": 2})["score"] == 0.0


def test_the_latency_tool_config_loads_with_its_latency():
    from verl_async.config.cli import REPO_ROOT
    from verl_async.tools import load_all_tools

    tool = load_all_tools(str(REPO_ROOT / "config/tool_config/calculator_latency_tool_config.yaml"), None)["calculator"]
    assert (tool.latency.low, tool.latency.high) == (0.5, 2.0)
