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
import sys
from typing import Any, Optional, Sequence

from data_preprocess.common import run_cli
from verl_async.data.files import verl_row

DATA_SOURCE = "openai/gsm8k"
CONFIG = "main"
SPLITS = ("train", "test")
DEFAULT_DIR = "~/data/gsm8k"
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
    extra_info = {"split": split, "index": idx, "answer": answer, "question": question}
    return verl_row(DATA_SOURCE, question + " " + INSTRUCTION, extract_solution(answer), "math", extra_info)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, str]:
    return run_cli(argv, sys.modules[__name__])


if __name__ == "__main__":
    main()
