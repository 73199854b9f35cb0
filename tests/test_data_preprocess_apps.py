"""The APPS-format preprocessor on a local fixture: verl rows whose test cases the code scorer runs."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from data_preprocess import apps

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "code", "apps_jsonl")


def test_rows_are_verl_code_rows_and_problems_without_tests_are_left_out(tmp_path, capsys):
    out = apps.main(["--local_dir", str(tmp_path), "--local_dataset_path", FIXTURE])
    train, test = (pq.read_table(out[s]).to_pylist() for s in ("train", "test"))
    assert len(train) == 4 and len(test) == 1  # problem 3 has no test cases
    assert "train: left out 1 of 5 problems without test cases" in capsys.readouterr().err
    first = train[0]
    assert first["data_source"] == "apps" and first["ability"] == "code"
    assert first["prompt"][0]["content"] == ("Read two integers a and b on one line and print their sum.\n\n"
                                             + apps.STDIN_INSTRUCTION)
    assert json.loads(first["reward_model"]["ground_truth"]) == {"inputs": ["1 2\n", "10 -3\n", "0 0\n"],
                                                                 "outputs": ["3\n", "7\n", "0\n"]}
    call = train[1]
    assert call["prompt"][0]["content"].endswith("```python\ndef largest(nums):\n```\n\n"
                                                 + apps.CALL_INSTRUCTION.format(fn_name="largest"))
    assert json.loads(call["reward_model"]["ground_truth"])["fn_name"] == "largest"
    assert call["extra_info"]["problem_id"] == 1 and call["extra_info"]["tests"] == 2


def test_the_rows_score_through_the_sandbox(tmp_path):
    from verl_async.reward import default_compute_score
    from verl_async.sandbox import isolation_problem

    if isolation_problem() and not os.environ.get("CI"):
        pytest.skip(f"no OS sandbox on this machine: {isolation_problem()}")
    out = apps.main(["--local_dir", str(tmp_path), "--local_dataset_path", FIXTURE])
    rows = pq.read_table(out["train"]).to_pylist()
    truth = {r["extra_info"]["problem_id"]: r["reward_model"]["ground_truth"] for r in rows}
    solve = {0: "a, b = map(int, input().split())\nprint(a + b)", 1: "def largest(nums):\n    return max(nums)",
             2: "print(input()[::-1])", 4: "n = int(input())\nprint(n * n)"}
    for pid, program in solve.items():
        assert default_compute_score("apps", f"```python\n{program}\n```", truth[pid])["score"] == 1.0, pid
    assert default_compute_score("apps", "```python\nprint(3)\n```", truth[0])["score"] == pytest.approx(1 / 3)


def test_a_file_of_only_untested_problems_is_refused(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps({"question": "q", "input_output": ""}) + "\n")
    with pytest.raises(SystemExit) as exit_:
        apps.main(["--local_dir", str(tmp_path / "out"), "--local_dataset_path", str(bad)])
    assert exit_.value.code == 2
