"""GSM8K -> verl-schema parquet (same rows as verl's examples/data_preprocess/gsm8k.py).

    python -m data_preprocess.gsm8k --local_dir ~/data/gsm8k [--local_dataset_path DIR_OR_FILE]

Input: the hub export of openai/gsm8k (`main/{train,test}-00000-of-00001.parquet`)
or the original repo's `train.jsonl` / `test.jsonl` ({"question", "answer"}).
Each row: the question with verl's instruction appended as the user message, the
number after `####` (commas removed) as ground truth, question and full answer kept
in extra_info.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from data_preprocess.common import run_cli

DATA_SOURCE = "openai/gsm8k"
CONFIG = "main"
SPLITS = ("train", "test")
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(answer: str) -> str:
    """The reference answer's final number, as verl stores it (commas removed)."""
    found = _FINAL.search(answer)
    if found is None:
        raise ValueError(f"answer has no '#### <number>' line: {answer[-80:]!r}")
    return found.group(1).replace(",", "")


def make_row(example: dict[str, Any], split: str, idx: int) -> dict[str, Any]:
    question, answer = example.pop("question"), example.pop("answer")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_solution(answer)},
        "extra_info": {"split": split, "index": idx, "answer": answer, "question": question},
    }


def main(argv: Optional[Sequence[str]] = None) -> dict[str, str]:
    return run_cli(
        argv,
        description="Preprocess GSM8K into verl's parquet schema",
        default_dir="~/data/gsm8k",
        data_source=DATA_SOURCE,
        splits=SPLITS,
        config=CONFIG,
        make_row=make_row,
    )


if __name__ == "__main__":
    main()
