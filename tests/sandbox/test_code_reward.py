"""Code-execution rewards: verl's test-case formats, prime_code's partial credit, local sandbox and SandboxFusion.

tests/fixtures/code/prime_code_king_moves.json is verl's own CPU test of prime_code (its
program, its two ground truths, its expected scores 1.0 and 0.9: the second's fourth case
expects a wrong answer, so 9 of the first 10 pass).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from verl_async.reward import default_compute_score
from verl_async.reward.code_score import (extract_program, parse_test_cases, result_matches, score_from,
                                          stdout_matches)
from verl_async.reward.manager import build_reward_manager
from verl_async.sandbox import isolation_problem

KING = json.loads((Path(__file__).parents[1] / "fixtures/code/prime_code_king_moves.json").read_text())


@pytest.fixture(scope="module")
def local_sandbox():
    problem = isolation_problem()
    if problem and not os.environ.get("CI"):
        pytest.skip(f"no OS sandbox on this machine: {problem}")


# ------------------------------------------------------------------ pure parts
def test_the_test_case_formats_verl_stores():
    cases = parse_test_cases('{"inputs": ["1 2\\n"], "outputs": ["3\\n"]}')
    assert (cases.inputs, cases.outputs, cases.fn_name, len(cases)) == (["1 2\n"], ["3\n"], None, 1)
    assert parse_test_cases({"inputs": ["[1]"], "outputs": ["2"], "fn_name": "f"}).fn_name == "f"
    asserts = parse_test_cases({"assert_case": ["assert f(1) == 2", "assert f(2) == 3"]})
    assert asserts.asserts == ["assert f(1) == 2", "assert f(2) == 3"] and asserts.outputs == [None, None]
    for bad, why in [("[1]", "JSON object"), ({"inputs": ["1"]}, "'inputs' and 'outputs'"),
                     ({"inputs": ["1"], "outputs": []}, "1 inputs but 0 outputs"), ({"inputs": [], "outputs": []},
                                                                                    "no test cases")]:
        with pytest.raises(ValueError, match=why):
            parse_test_cases(bad)


def test_the_program_is_primes_last_python_block():
    assert extract_program("text\n```python\na = 1\n```\nmore\n```python\nb = 2\n```") == "\nb = 2\n"
    assert extract_program("print(1)") == "print(1)"


@pytest.mark.parametrize("actual, expected, same", [
    ("3\n", "3", True), ("3", "3\n\n", True), ("1 2 \n3\n", "1 2\n3", True), ("1  2\n", "1 2", True),
    ("0.3333333\n", "0.33333333", True), ("4\n", "5\n", False), ("1 2", "1 2 3", False), ("YES", "yes", False),
    ("1\n2\n", ["1", "2"], True),
])
def test_stdout_comparison(actual, expected, same):
    assert stdout_matches(actual, expected) is same


def test_call_based_results_compare_as_json():
    assert result_matches("[1, 2]\n", "[1, 2]") and result_matches("[1, 2]\n", [[1, 2]]) and result_matches("5\n", 5)
    assert not result_matches("[2, 1]\n", "[1, 2]")


@pytest.mark.parametrize("passed, score, acc", [
    ([True] * 11, 1.0, 1.0), ([True] * 3 + [False] + [True] * 7, 0.9, 0.0),  # prime_code's continuous score
    ([True] * 10 + [False], 1.0, 0.0),  # the first 10 pass: prime_code gives 1.0, acc says not all
    ([False, True], 0.5, 0.0), ([], 0.0, 0.0),
])
def test_prime_code_partial_credit(passed, score, acc):
    result = score_from(passed)
    assert result["score"] == pytest.approx(score) and result["acc"] == acc


# ------------------------------------------------------------------ through the built-in sandbox
def test_verls_prime_code_example_scores_as_in_verl(local_sandbox):
    for ground_truth, expected in zip(KING["ground_truths"], KING["scores"]):
        result = default_compute_score("codecontests", KING["program"], json.dumps(ground_truth))
        assert result["score"] == pytest.approx(expected) and result["cases"] == 11.0
    wrong = default_compute_score("apps", "```python\nprint(-1)\n```", KING["ground_truths"][0])
    assert 0 < wrong["score"] < 1 and wrong["acc"] == 0.0  # -1 is right for 3 of the first 10


def test_call_based_and_assert_cases(local_sandbox):
    program = "```python\nclass Solution:\n    def twoSum(self, nums, target):\n" \
              "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n" \
              "                return [seen[target - x], i]\n            seen[x] = i\n```"
    cases = {"inputs": ["[2, 7, 11, 15]\n9", "[3, 2, 4]\n6", "[3, 3]\n6"], "outputs": ["[0, 1]", "[1, 2]", "[0, 2]"],
             "fn_name": "twoSum"}
    result = default_compute_score("taco", program, cases)
    assert result["score"] == pytest.approx(2 / 3)  # the last case expects [0, 2]; the answer is [0, 1]
    asserts = {"assert_case": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]}
    assert default_compute_score("apps", "def add(a, b):\n    return a + b", asserts)["score"] == 0.5


def test_a_program_that_never_ends_costs_its_score_not_the_scorer(local_sandbox):
    t0 = time.monotonic()
    result = default_compute_score("codeforces", "while True:\n    pass", {"inputs": ["1"] * 3, "outputs": ["1"] * 3},
                                   deadline_s=3.0, case_timeout_s=1.0)
    assert result["score"] == 0.0 and time.monotonic() - t0 < 6


def test_the_reward_manager_scores_code_in_its_worker_processes(local_sandbox):
    manager = build_reward_manager({"timeout_s": 20.0, "num_workers": 1}, sandbox_fusion={"url": None})
    try:
        rewards = manager.score_texts([KING["program"], "print('nope')"], [10, 10], "codecontests",
                                      json.dumps(KING["ground_truths"][1]))
    finally:
        manager.close()
    assert [r.reward for r in rewards] == [pytest.approx(0.9), 0.0]
    assert rewards[0].error is None and rewards[0].info["cases"] == 11.0


# ------------------------------------------------------------------ through SandboxFusion (the built-in server)
def test_the_same_scores_through_sandbox_fusion(server):
    manager = build_reward_manager({"timeout_s": 30.0}, sandbox_fusion={"url": server, "max_concurrent": 4,
                                                                        "memory_limit_mb": 512})
    try:
        rewards = [manager.score_texts([KING["program"]], [10], "codecontests", json.dumps(gt))[0]
                   for gt in KING["ground_truths"]]
    finally:
        manager.close()
    assert [r.reward for r in rewards] == [pytest.approx(1.0), pytest.approx(0.9)]


def test_an_unreachable_service_is_refused_at_start(tmp_path):
    from tests.sandbox_server import free_port

    url = f"http://127.0.0.1:{free_port()}/run_code"
    with pytest.raises(ValueError, match=r"^reward\.sandbox_fusion\.url=.*: no SandboxFusion service runs code there"):
        build_reward_manager({"timeout_s": 5.0}, sandbox_fusion={"url": url})
