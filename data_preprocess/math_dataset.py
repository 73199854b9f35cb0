"""MATH (DigitalLearningGmbH/MATH-lighteval) -> verl-schema parquet (verl's math_dataset.py).

    python -m data_preprocess.math_dataset --local_dir ~/data/math [--local_dataset_path DIR_OR_FILE]

Input: the hub export (`data/{train,test}-00000-of-00001.parquet`, columns problem,
level, type, solution) or jsonl files with those fields. Each row: the problem with
verl's instruction appended, the last `\\boxed{}` of the reference solution as ground
truth. `level` and `type` stay as top-level columns, as verl's `datasets.map` leaves them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from data_preprocess.common import run_cli
from verl_async.reward.math_answer import last_boxed_only_string, remove_boxed

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
CONFIG = "default"
SPLITS = ("train", "test")
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def extract_solution(solution: str) -> str:
    boxed = last_boxed_only_string(solution)
    if boxed is None:
        raise ValueError(f"solution has no \\boxed{{...}} answer: {solution[-80:]!r}")
    return remove_boxed(boxed)


def make_row(example: dict[str, Any], split: str, idx: int) -> dict[str, Any]:
    problem, solution = example.pop("problem"), example.pop("solution")
    return {
        **example,  # level, type
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_solution(solution)},
        "extra_info": {"split": split, "index": idx},
    }


def main(argv: Optional[Sequence[str]] = None) -> dict[str, str]:
    return run_cli(
        argv,
        description="Preprocess MATH-lighteval into verl's parquet schema",
        default_dir="~/data/math",
        data_source=DATA_SOURCE,
        splits=SPLITS,
        config=CONFIG,
        make_row=make_row,
    )


if __name__ == "__main__":
    main()
