"""The generated arithmetic task, the gsm8k_method key, and GSM8K's real files."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re

import pyarrow.parquet as pq
import pytest

from data_preprocess import arithmetic, gsm8k
from verl_async.reward import default_compute_score
from verl_async.reward.manager import build_reward_manager

SHARED_GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "datasets", "gsm8k")


def test_splits_are_deterministic_held_out_and_balanced():
    a = arithmetic.generate_splits(700, 140, seed=3)
    b = arithmetic.generate_splits(700, 140, seed=3)
    assert a == b
    assert arithmetic.generate_splits(700, 140, seed=4) != a
    train_q = {r["extra_info"]["question"] for r in a["train"]}
    test_q = {r["extra_info"]["question"] for r in a["test"]}
    assert len(train_q) == 700 and len(test_q) == 140 and not train_q & test_q
    kinds = collections.Counter(r["extra_info"]["kind"] for r in a["train"])
    assert set(kinds) == {"add", "sub", "mul", "div", "mul_add", "add_sub", "price"}
    assert max(kinds.values()) - min(kinds.values()) <= 1


def _evaluate_steps(solution: str) -> int:
    """Recompute every 'x op y = z' in the worked answer; return the final '#### N'."""
    for x, op, y, z in re.findall(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)", solution):
        x, y, z = int(x), int(y), int(z)
        assert {"+": x + y, "-": x - y, "*": x * y, "/": x / y}[op] == z, solution
    return int(solution.rsplit("#### ", 1)[1])


def test_every_answer_is_right_and_scored_by_gsm8k_rules():
    for row in arithmetic.generate_splits(300, 60, seed=0)["train"]:
        truth = row["reward_model"]["ground_truth"]
        solution = row["extra_info"]["answer"]
        assert _evaluate_steps(solution) == int(truth) >= 0
        assert row["data_source"] == "verl_async/arithmetic"
        assert row["prompt"][0]["content"].endswith(gsm8k.INSTRUCTION)
        assert default_compute_score(row["data_source"], solution, truth)["score"] == 1.0


def test_cli_writes_parquet(tmp_path):
    out = arithmetic.main(["--local_dir", str(tmp_path), "--train_size", "50", "--test_size", "10", "--seed", "1"])
    assert pq.read_table(out["train"]).num_rows == 50 and pq.read_table(out["test"]).num_rows == 10
    assert pq.read_schema(out["test"]).names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def test_asking_for_more_distinct_problems_than_exist_is_an_error():
    def three(rng):  # a template with three possible questions
        return arithmetic.Problem(f"q{rng.randint(1, 3)}", "#### 1", 1, "toy")

    assert len(arithmetic.generate(3, seed=0, templates=[three])) == 3
    with pytest.raises(ValueError, match=r"cannot draw 4 distinct problems \(got 3\)"):
        arithmetic.generate(4, seed=0, templates=[three])


@pytest.mark.parametrize("method,scores", [("strict", [1.0, 0.0, 0.0]), ("flexible", [1.0, 1.0, 0.0])])
def test_gsm8k_method_key_picks_the_answer_format(method, scores):
    manager = build_reward_manager({"reward_manager": "naive", "gsm8k_method": method})
    texts = ["so #### 12", "The answer is 12.", "The answer is 13."]
    for source in ("openai/gsm8k", "verl_async/arithmetic"):
        assert [r.reward for r in manager.score_texts(texts, [3, 3, 3], source, "12")] == scores


@pytest.mark.skipif(not os.path.isdir(SHARED_GSM8K), reason="../shared/datasets/gsm8k not present")
def test_real_gsm8k_release_converts_unchanged(tmp_path):
    digests = {"train.jsonl": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
               "test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"}
    for name, digest in digests.items():
        with open(os.path.join(SHARED_GSM8K, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest
    out = gsm8k.main(["--local_dir", str(tmp_path), "--local_dataset_path", SHARED_GSM8K])
    for split, rows in (("train", 7473), ("test", 1319)):
        table = pq.read_table(out[split]).to_pylist()
        assert len(table) == rows
        with open(os.path.join(SHARED_GSM8K, f"{split}.jsonl")) as f:
            raw = [json.loads(line) for line in f]
        for row, original in zip(table, raw):
            assert row["extra_info"]["question"] == original["question"]
            assert row["extra_info"]["answer"] == original["answer"]
            assert row["prompt"][0]["content"] == original["question"] + " " + gsm8k.INSTRUCTION
            # the reference answer scores 1 under the strict rule against the stored ground truth
            assert default_compute_score("openai/gsm8k", original["answer"], row["reward_model"]["ground_truth"])["score"] == 1.0
