"""APPS-format code problems (APPS, TACO) -> verl-schema parquet scored by running their test cases.

    python -m data_preprocess.apps --local_dir ~/data/apps --local_dataset_path DIR_OR_FILE

Input: jsonl / json / parquet files named by split (`train.jsonl`, `test-00000-of-00001.parquet`,
a folder of them), one problem per row in the format codeparrot/apps and BAAI/TACO share:

    {"question": str, "input_output": JSON string {"inputs": [...], "outputs": [...], "fn_name"?: str},
     "starter_code": str (may be empty), "problem_id"?: int, "difficulty"?: str, ...}

Each row: the question (and its starter code) with an instruction to answer with one
```python block as the user message; data_source `apps` (scored by running the test cases in
the sandbox: verl_async/reward/code_score.py); the test cases, as a JSON string, as ground
truth. Problems without test cases are left out (counted on stderr). Your own problems in
this format work the same way: a file per split.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional, Sequence

from data_preprocess.common import PreprocessError, build_parser, convert, load_raw
from verl_async.data.files import verl_row

DATA_SOURCE = "apps"  # the row's data_source: one of verl's code sources (reward/code_score.py)
HUB_ID = "codeparrot/apps"
CONFIG = None
SPLITS = ("train", "test")
DEFAULT_DIR = "~/data/apps"
STDIN_INSTRUCTION = ("Write a Python 3 program that reads the input from standard input and prints the answer. "
                     "Put the whole program in one ```python code block.")
CALL_INSTRUCTION = ("Complete the function `{fn_name}` in Python 3 (start from the code given) and put the whole "
                    "code in one ```python code block.")


def test_cases(row: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The row's test cases ({"inputs", "outputs"[, "fn_name"]}), None when it has none."""
    raw = row.get("input_output")
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    cases = json.loads(raw) if isinstance(raw, str) else dict(raw)
    inputs, outputs = cases.get("inputs"), cases.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
        return None
    if len(inputs) != len(outputs):
        raise ValueError(f"input_output has {len(inputs)} inputs but {len(outputs)} outputs")
    kept = {"inputs": inputs, "outputs": outputs}
    if cases.get("fn_name"):
        kept["fn_name"] = str(cases["fn_name"])
    return kept


def make_row(example: dict[str, Any], split: str, idx: int) -> dict[str, Any]:
    question = example.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("no 'question' text")
    cases = test_cases(example)
    if cases is None:
        raise ValueError("no test cases in 'input_output'")
    starter = (example.get("starter_code") or "").strip()
    instruction = CALL_INSTRUCTION.format(fn_name=cases["fn_name"]) if "fn_name" in cases else STDIN_INSTRUCTION
    content = question.strip() + (f"\n\n```python\n{starter}\n```" if starter else "") + "\n\n" + instruction
    extra_info = {"split": split, "index": idx, "problem_id": example.get("problem_id", idx),
                  "difficulty": str(example.get("difficulty") or ""), "tests": len(cases["inputs"])}
    return verl_row(DATA_SOURCE, content, json.dumps(cases), "code", extra_info)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, str]:
    parser = build_parser((__doc__ or "").strip().splitlines()[0], DEFAULT_DIR, HUB_ID)
    args = parser.parse_args(argv)
    try:
        raw = load_raw(args, SPLITS, CONFIG)
        usable = {}
        for split, rows in raw.items():
            usable[split] = [row for row in rows if test_cases(row) is not None]
            if len(usable[split]) < len(rows):
                print(f"{split}: left out {len(rows) - len(usable[split])} of {len(rows)} problems without test "
                      "cases", file=sys.stderr)
            if not usable[split]:
                raise PreprocessError(f"{split}: no problem has test cases (input_output)")
        return convert(usable, make_row, args.local_dir)
    except (PreprocessError, OSError, ValueError) as exc:
        parser.exit(2, f"error: {exc}\n")


if __name__ == "__main__":
    main()
