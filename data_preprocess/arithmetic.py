"""GSM8K-format arithmetic word problems (one and two steps) -> verl-schema parquet.

    python -m data_preprocess.arithmetic --local_dir ~/data/arithmetic [--train_size 5000 --test_size 500 --seed 0]

Why: a 135M instruct model (SmolLM2) gets 1.6% on GSM8K but ~10% greedy on one- and
two-step word problems, so RL can visibly move it within minutes on one GPU. The rows
look like verl's GSM8K rows (the question plus verl's instruction as the user message,
the final number as ground truth, a worked answer ending in `#### N` in extra_info) and
are scored by the GSM8K scorer (data_source `verl_async/arithmetic`): `strict` wants
`#### N`, `flexible` takes the last number (`reward_model.gsm8k_method`).

Seeds are fixed: train uses `seed`, test `seed + 1`, and no test question appears in
train (duplicates are drawn again), so the test split is held out.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from data_preprocess.gsm8k import INSTRUCTION
from verl_async.data.files import verl_row, write_rows

DATA_SOURCE = "verl_async/arithmetic"
DEFAULT_DIR = "~/data/arithmetic"
SPLIT_SIZES = {"train": 5000, "test": 500}
DEFAULT_SEED = 0

NAMES = ("Tom", "Anna", "Lena", "Omar", "Mia", "Ravi", "Sara", "Ben", "Yuki", "Carlos", "Emma", "Noah")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "stamps", "cards", "shells")
CONTAINERS = ("boxes", "bags", "packs", "baskets", "jars", "crates")


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # worked steps, ending in "#### N"
    answer: int
    kind: str


def _finish(question: str, steps: list[str], answer: int, kind: str) -> Problem:
    return Problem(question, "\n".join(steps + [f"#### {answer}"]), answer, kind)


def _add(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(3, 60), rng.randint(2, 40)
    return _finish(f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?",
                   [f"{name} has {a} + {b} = {a + b} {item}."], a + b, "add")


def _sub(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(10, 80)
    b = rng.randint(1, a - 1)
    return _finish(f"{name} had {a} {item} and gave {b} of them to a friend. How many {item} does {name} have left?",
                   [f"{name} has {a} - {b} = {a - b} {item} left."], a - b, "sub")


def _mul(rng: random.Random) -> Problem:
    name, item, box = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return _finish(f"{name} buys {a} {box} of {item}. Each of the {box} holds {b} {item}. How many {item} does {name} buy?",
                   [f"{name} buys {a} * {b} = {a * b} {item}."], a * b, "mul")


def _div(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    per, friends = rng.randint(2, 12), rng.randint(2, 8)
    total = per * friends
    return _finish(f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?",
                   [f"Each friend gets {total} / {friends} = {per} {item}."], per, "div")


def _mul_add(rng: random.Random) -> Problem:
    name, item, box = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(CONTAINERS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 30)
    return _finish(
        f"{name} has {a} {box} with {b} {item} in each, and {c} loose {item}. How many {item} does {name} have in all?",
        [f"The {box} hold {a} * {b} = {a * b} {item}.", f"In all {a * b} + {c} = {a * b + c} {item}."],
        a * b + c, "mul_add")


def _add_sub(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(5, 50), rng.randint(2, 40)
    c = rng.randint(1, a + b - 1)
    return _finish(
        f"{name} has {a} {item}, buys {b} more, and then loses {c}. How many {item} does {name} have now?",
        [f"After buying, {name} has {a} + {b} = {a + b} {item}.", f"After losing some, {a + b} - {c} = {a + b - c} {item}."],
        a + b - c, "add_sub")


def _price(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 9), rng.randint(2, 15)
    paid = count * price + rng.randint(1, 20)
    cost = count * price
    return _finish(
        f"{name} buys {count} {item} at ${price} each and pays with ${paid}. How many dollars of change does {name} get?",
        [f"The {item} cost {count} * {price} = ${cost}.", f"The change is {paid} - {cost} = ${paid - cost}."],
        paid - cost, "price")


TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (_add, _sub, _mul, _div, _mul_add, _add_sub, _price)


def generate(size: int, seed: int, exclude: frozenset[str] = frozenset(),
             templates: Sequence[Callable[[random.Random], Problem]] = TEMPLATES) -> list[Problem]:
    """`size` distinct problems (templates in turn), none of whose questions is in `exclude`."""
    rng = random.Random(seed)
    seen, out = set(exclude), []
    misses = 0
    while len(out) < size:
        problem = templates[len(out) % len(templates)](rng)
        if problem.question in seen:
            misses += 1
            if misses > 1000:  # 1000 duplicates in a row: the templates have no more to give
                raise ValueError(f"cannot draw {size} distinct problems (got {len(out)}); ask for fewer")
            continue
        misses = 0
        seen.add(problem.question)
        out.append(problem)
    return out


def to_row(problem: Problem, split: str, idx: int) -> dict:
    extra = {"split": split, "index": idx, "question": problem.question, "answer": problem.solution,
             "kind": problem.kind}
    return verl_row(DATA_SOURCE, problem.question + " " + INSTRUCTION, str(problem.answer), "math", extra)


def generate_splits(train_size: int = SPLIT_SIZES["train"], test_size: int = SPLIT_SIZES["test"],
                    seed: int = DEFAULT_SEED) -> dict[str, list[dict]]:
    test = generate(test_size, seed + 1)
    train = generate(train_size, seed, exclude=frozenset(p.question for p in test))
    return {"train": [to_row(p, "train", i) for i, p in enumerate(train)],
            "test": [to_row(p, "test", i) for i, p in enumerate(test)]}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--local_dir", "--local_save_dir", dest="local_dir", default=DEFAULT_DIR)
    parser.add_argument("--train_size", type=int, default=SPLIT_SIZES["train"])
    parser.add_argument("--test_size", type=int, default=SPLIT_SIZES["test"])
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="train seed; test uses seed + 1, held out")
    args = parser.parse_args(argv)
    if args.train_size < 1 or args.test_size < 1:
        parser.error("--train_size and --test_size must be >= 1")
    out = os.path.expanduser(args.local_dir)
    written = {split: write_rows(rows, os.path.join(out, f"{split}.parquet"))
               for split, rows in generate_splits(args.train_size, args.test_size, args.seed).items()}
    for split, path in written.items():
        print(f"wrote {split}: {path}", file=sys.stderr)
    return written


if __name__ == "__main__":
    main()
