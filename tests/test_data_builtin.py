"""The built-in repeat task: builtin:// resolution, determinism, solution, length statistics."""

from __future__ import annotations

import os
import random

import numpy as np
import pyarrow.parquet as pq
import pytest

from data_preprocess import builtin_task
from verl_async.data import PromptDataset, builtin, resolve_data_files, write_rows
from verl_async.models.tiny import build_char_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_ASYNC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "data"


def test_builtin_resolution_is_cached_and_deterministic(cache, tmp_path, monkeypatch):
    train, val = resolve_data_files(["builtin://train", "builtin://val"])
    assert os.path.dirname(train) == str(cache) and os.path.exists(val)
    assert pq.read_table(train).num_rows == 2000 and pq.read_table(val).num_rows == 200
    mtime = os.stat(train).st_mtime_ns
    assert resolve_data_files("builtin://train") == [train] and os.stat(train).st_mtime_ns == mtime  # not rebuilt
    # another cache, same content: generation depends on the seed only
    monkeypatch.setenv("VERL_ASYNC_CACHE", str(tmp_path / "other"))
    (again,) = resolve_data_files("builtin://train")
    assert again != train and pq.read_table(again).equals(pq.read_table(train))
    with pytest.raises(ValueError, match="unknown built-in dataset builtin://test"):
        resolve_data_files("builtin://test")


def test_val_is_held_out_and_rows_are_consistent():
    splits = builtin.generate_splits()
    assert splits == builtin.generate_splits()
    train_prompts = {r["prompt"][0]["content"] for r in splits["train"]}
    val_prompts = {r["prompt"][0]["content"] for r in splits["val"]}
    assert len(train_prompts) == 2000 and len(val_prompts) == 200 and not train_prompts & val_prompts
    for split, rows in splits.items():
        for i, r in enumerate(rows):
            content = r["prompt"][0]["content"]
            assert r["data_source"] == builtin.DATA_SOURCE and r["extra_info"]["split"] == split
            assert r["extra_info"]["index"] == i and r["reward_model"]["style"] == "rule"
            assert builtin.solution(content) == r["reward_model"]["ground_truth"]
            assert builtin.compute_score(builtin.solution(content), r["reward_model"]["ground_truth"],
                                         r["extra_info"])["acc"] == 1.0
    assert builtin.generate_splits(seed=5)["train"] != splits["train"]


def test_solution_rejects_foreign_prompts():
    assert builtin.solution("Repeat 'xy' 3 times.") == "xyxyxy"
    with pytest.raises(ValueError, match="not a built-in repeat prompt"):
        builtin.solution("What is 2 + 2?")


def test_lengths_vary_with_a_long_tail_and_fit_the_defaults():
    tok = build_char_tokenizer()
    rows = builtin.generate_splits()["train"]
    resp = np.array([len(tok(r["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"]) + 1 for r in rows])
    assert resp.min() == 2 and 55 <= resp.max() <= 61  # + EOS; data.max_response_length is 64
    assert 6 <= np.median(resp) <= 16 and np.percentile(resp, 90) >= 30
    assert resp.std() / resp.mean() > 0.6  # a long tail, not a narrow band
    prompt_text = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    prompts = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in prompt_text]
    assert max(prompts) <= 64  # data.max_prompt_length is 128


def test_sample_task_distribution_is_skewed():
    rng = random.Random(0)
    times = [builtin.sample_task(rng)[1] for _ in range(5000)]
    counts = np.bincount(times, minlength=21)[1:]
    assert counts[0] > counts[9] > counts[19] > 0


def test_resolve_passes_real_paths_through(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    a = write_rows(builtin.generate_rows("train", 3, 0), str(tmp_path / "d" / "b.parquet"))
    write_rows(builtin.generate_rows("train", 3, 0), str(tmp_path / "d" / "a.parquet"))
    assert resolve_data_files("~/d/b.parquet") == [a]
    assert resolve_data_files(("~/d",)) == [str(tmp_path / "d" / "a.parquet"), a]
    assert resolve_data_files(["/x/y.parquet"]) == ["/x/y.parquet"]  # missing: the loader reports it
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="data.val_files: folder .* holds no .parquet"):
        resolve_data_files(str(tmp_path / "empty"), key="data.val_files")
    with pytest.raises(ValueError, match="data.train_files is not set"):
        resolve_data_files(None)
    with pytest.raises(ValueError, match="data.train_files is empty"):
        resolve_data_files([])


def test_builtin_task_cli(tmp_path):
    out = builtin_task.main(["--local_dir", str(tmp_path / "b"), "--train_size", "30", "--val_size", "7", "--seed", "4"])
    ds = PromptDataset(out["train"], build_char_tokenizer(), max_prompt_length=128)
    assert len(ds) == 30 and pq.read_table(out["val"]).num_rows == 7
    assert pq.read_table(out["train"]).to_pylist() == builtin.generate_splits(30, 7, 4)["train"]
