"""The arithmetic task with a tool: rows whose system prompt shows the model one tool call (few-shot).

    python -m data_preprocess.arithmetic_tools --local_dir ~/data/arith_tools [--tool calculator|code_interpreter]

Same problems and splits as `data_preprocess.arithmetic` (GSM8K format, `#### N`, held-out
test split), plus what a multi-turn run needs: a system message that explains the hermes
call format and shows one worked call, and verl's `agent_name: tool_agent` column. Use
with `actor_rollout_ref.rollout.multi_turn.enable=true` and the matching tool config
(`config/tool_config/calculator_tool_config.yaml` or `python_tool_config.yaml`).

A 135M instruct model seldom writes a call from the prompt alone: measured on CPU (sampling
at 0.7, 32 samples of four questions) SmolLM2-135M-Instruct wrote `<tool_call>` in 1 of 32
samples with a one-call few-shot prompt, 0 of 32 without it (issue 23).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from data_preprocess import arithmetic
from verl_async.data.files import write_rows

TOOLS = ("calculator", "code_interpreter")
_EXAMPLE_QUESTION = "Mia has 4 bags with 6 marbles in each. How many marbles does Mia have?"
_EXAMPLE_CALL = {
    "calculator": '{"name": "calculator", "arguments": {"expression": "4 * 6"}}',
    "code_interpreter": '{"name": "code_interpreter", "arguments": {"code": "print(4 * 6)"}}',
}
_WHAT = {
    "calculator": "a calculator tool that evaluates an arithmetic expression",
    "code_interpreter": "a Python tool that runs code and returns what it prints",
}


def system_prompt(tool: str) -> str:
    """The few-shot system message: the call format and one worked example."""
    if tool not in TOOLS:
        raise ValueError(f"--tool {tool!r}: expected one of {TOOLS}")
    return (
        f"You solve arithmetic word problems. You can use {_WHAT[tool]}. To use it, write exactly\n"
        f"<tool_call>\n{_EXAMPLE_CALL[tool]}\n</tool_call>\n"
        "and stop; the result comes back in the next message. Then give the final answer after \"####\".\n\n"
        f"Example.\nUser: {_EXAMPLE_QUESTION}\n"
        f"Assistant: <tool_call>\n{_EXAMPLE_CALL[tool]}\n</tool_call>\n"
        "Tool: 24\n"
        "Assistant: Mia has 24 marbles.\n#### 24"
    )


def with_tool(row: dict, tool: str) -> dict:
    """An arithmetic row as a multi-turn row: the system prompt first, verl's agent_name column."""
    return {**row, "prompt": [{"role": "system", "content": system_prompt(tool)}] + list(row["prompt"]),
            "agent_name": "tool_agent"}


def generate_splits(tool: str, train_size: int, test_size: int, seed: int) -> dict[str, list[dict]]:
    return {split: [with_tool(r, tool) for r in rows]
            for split, rows in arithmetic.generate_splits(train_size, test_size, seed).items()}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--local_dir", "--local_save_dir", dest="local_dir", default="~/data/arith_tools")
    parser.add_argument("--tool", choices=TOOLS, default="calculator")
    parser.add_argument("--train_size", type=int, default=arithmetic.SPLIT_SIZES["train"])
    parser.add_argument("--test_size", type=int, default=arithmetic.SPLIT_SIZES["test"])
    parser.add_argument("--seed", type=int, default=arithmetic.DEFAULT_SEED)
    args = parser.parse_args(argv)
    if args.train_size < 1 or args.test_size < 1:
        parser.error("--train_size and --test_size must be >= 1")
    out = os.path.expanduser(args.local_dir)
    splits = generate_splits(args.tool, args.train_size, args.test_size, args.seed)
    written = {split: write_rows(rows, os.path.join(out, f"{split}.parquet")) for split, rows in splits.items()}
    for split, path in written.items():
        print(f"wrote {split}: {path}", file=sys.stderr)
    return written


if __name__ == "__main__":
    main()
