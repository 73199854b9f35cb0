"""MATH (DigitalLearningGmbH/MATH-lighteval) -> verl-schema parquet (verl's math_dataset.py).

    python -m data_preprocess.math_dataset --local_dir ~/data/math [--local_dataset_path DIR_OR_FILE]

Input: the hub export (`data/{train,test}-00000-of-00001.parquet`, columns problem,
level, type, solution) or jsonl files with those fields. Each row: the problem with
verl's instruction appended, the last `\\boxed{}` of the reference solution as ground
truth. `level` and `type` stay as top-level columns, as verl's `datasets.map` leaves them.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

from data_preprocess.common import run_cli
from verl_async.data.files import verl_row
from verl_async.reward.math_answer import last_boxed_only_string, remove_boxed

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
CONFIG = "default"
SPLITS = ("train", "test")
DEFAULT_DIR = "~/data/math"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def extract_solution(solution: str) -> str:
    boxed = last_boxed_only_string(solution)
    if boxed is None:
        raise ValueError(f"solution has no \\boxed{{...}} answer: {solution[-80:]!r}")
    return remove_boxed(boxed)


def make_row(example: dict[str, Any], split: str, idx: int) -> dict[str, Any]:
    problem, solution = example.pop("problem"), example.pop("solution")
    row = verl_row(DATA_SOURCE, problem + " " + INSTRUCTION, extract_solution(solution), "math",
                   {"split": split, "index": idx})
    return {**example, **row}  # level, type first, as verl's datasets.map leaves them


def main(argv: Optional[Sequence[str]] = None) -> dict[str, str]:
    return run_cli(argv, sys.modules[__name__])


if __name__ == "__main__":
    main()
