"""Prompt dataset: schema checks, bad rows, overlong prompts, and the resumable iterator."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from verl_async.data import DataError, PromptDataset, PromptIterator, builtin, truncate, write_rows
from verl_async.models.tiny import build_char_tokenizer

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "config")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def row(content="Repeat 'ab' 2 times.", truth="abab", source="verl_async/builtin_repeat", **extra):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "copy",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": 0, **extra},
    }


def write(tmp_path, rows, name="d.parquet"):
    return write_rows(rows, str(tmp_path / name))


def test_loads_rows_applies_chat_template(tmp_path, tok):
    path = write(tmp_path, [row(), row("Repeat 'x' 3 times.", "xxx")])
    ds = PromptDataset(path, tok, max_prompt_length=128)
    assert len(ds) == 2 and ds.stats.rows_kept == 2
    item = ds[1]
    assert item.index == 1 and item.ground_truth == "xxx" and item.data_source == "verl_async/builtin_repeat"
    assert item.raw_prompt == "<|im_start|>user\nRepeat 'x' 3 times.<|im_end|>\n<|im_start|>assistant\n"
    assert item.prompt_ids == tok(item.raw_prompt, add_special_tokens=False)["input_ids"]
    assert item.extra_info["split"] == "train" and item.ability == "copy"
    assert item.messages == [{"role": "user", "content": "Repeat 'x' 3 times."}]
    assert item.source == f"{path}:1"


def test_several_files_and_a_folder(tmp_path, tok):
    write(tmp_path, [row()], "a.parquet")
    write(tmp_path, [row(), row()], "b.parquet")
    assert len(PromptDataset([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], tok)) == 3
    assert len(PromptDataset(str(tmp_path), tok)) == 3


def test_missing_file(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match=r"data.val_files: .*nope.parquet: no such file"):
        PromptDataset(str(tmp_path / "nope.parquet"), tok, key="data.val_files")


def test_empty_file(tmp_path, tok):
    path = tmp_path / "empty.parquet"
    path.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty.parquet: empty file \(0 bytes\)"):
        PromptDataset(str(path), tok)


def test_zero_row_parquet(tmp_path, tok):
    path = str(tmp_path / "zero.parquet")
    pq.write_table(pa.Table.from_pylist([row()]).slice(0, 0), path)
    with pytest.raises(DataError, match="zero.parquet: the file has no rows"):
        PromptDataset(path, tok)


def test_not_parquet(tmp_path, tok):
    path = tmp_path / "train.parquet"
    path.write_text('{"prompt": "this is jsonl"}\n')
    with pytest.raises(DataError, match="train.parquet: not a readable parquet file"):
        PromptDataset(str(path), tok)


@pytest.mark.parametrize("column", ["prompt", "reward_model", "data_source"])
def test_missing_column(tmp_path, tok, column):
    rows = [{k: v for k, v in row().items() if k != column}]
    path = write(tmp_path, rows)
    with pytest.raises(DataError, match=rf"d.parquet: missing column '{column}'"):
        PromptDataset(path, tok)


@pytest.mark.parametrize(
    "column,value,match",
    [
        ("prompt", "Repeat 'ab' 2 times.", "column 'prompt' has type string, expected a list of chat messages"),
        ("prompt", [{"text": "hi"}], "column 'prompt' has type list<.*text.*expected a list of chat messages"),
        ("reward_model", "abab", "column 'reward_model' has type string, expected struct"),
        ("reward_model", {"style": "rule"}, "column 'reward_model' has type struct<style: string>"),
        ("data_source", 7, "column 'data_source' has type int64, expected string"),
        ("extra_info", "notes", "column 'extra_info' has type string, expected a struct"),
    ],
)
def test_wrong_column_type(tmp_path, tok, column, value, match):
    path = write(tmp_path, [{**row(), column: value}])
    with pytest.raises(DataError, match=match):
        PromptDataset(path, tok)


def test_prompt_key_is_configurable(tmp_path, tok):
    rows = [{**{k: v for k, v in row().items() if k != "prompt"}, "messages": row()["prompt"]}]
    path = write(tmp_path, rows)
    assert len(PromptDataset(path, tok, prompt_key="messages")) == 1
    with pytest.raises(DataError, match="missing column 'prompt'"):
        PromptDataset(path, tok)


BAD_ROWS = [
    ({"prompt": []}, "prompt is not a non-empty list"),
    ({"prompt": [{"role": "user", "content": None}]}, "prompt message 0 has no text content"),
    ({"prompt": [{"role": None, "content": "hi"}]}, "prompt message 0 has no role"),
    ({"reward_model": {"style": "rule", "ground_truth": None}}, "reward_model.ground_truth is missing"),
    ({"reward_model": None}, "reward_model.ground_truth is missing"),
    ({"data_source": None}, "data_source is missing"),
]


def test_bad_rows_are_skipped_and_counted(tmp_path, tok):
    rows = [row()] + [{**row(), **patch} for patch, _ in BAD_ROWS] + [row("Repeat 'q' 1 times.", "q")]
    path = write(tmp_path, rows)
    ds = PromptDataset(path, tok)
    assert len(ds) == 2 and [it.ground_truth for it in ds] == ["abab", "q"]
    assert [it.index for it in ds] == [0, 1]
    assert ds.stats.bad_rows == len(BAD_ROWS) and ds.stats.rows_read == len(rows)
    got = [(b.file, b.row, b.reason[: len(reason)]) for b, (_, reason) in zip(ds.stats.bad_row_examples, BAD_ROWS)]
    assert got == [(path, i + 1, reason) for i, (_, reason) in enumerate(BAD_ROWS)]


@pytest.mark.parametrize("index", range(len(BAD_ROWS)))
def test_bad_rows_fail_without_skip(tmp_path, tok, index):
    patch, reason = BAD_ROWS[index]
    path = write(tmp_path, [row(), {**row(), **patch}])
    with pytest.raises(DataError, match=rf"d.parquet: row 1: {reason}.*skip_bad_rows=false"):
        PromptDataset(path, tok, skip_bad_rows=False)


def test_all_rows_bad_is_an_error(tmp_path, tok):
    path = write(tmp_path, [{**row(), "data_source": None}])
    with pytest.raises(DataError, match="no usable prompt"):
        PromptDataset(path, tok)


LONG = "Repeat 'abc' 20 times, and please take care to count the repetitions exactly right."


def test_truncation_error_names_file_row_and_lengths(tmp_path, tok):
    path = write(tmp_path, [row(), row(LONG)])
    text = tok.apply_chat_template([{"role": "user", "content": LONG}], tokenize=False, add_generation_prompt=True)
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    with pytest.raises(DataError, match=rf"d.parquet: row 1: prompt is {n} tokens, longer than data.max_prompt_length=48"):
        PromptDataset(path, tok, max_prompt_length=48)


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(tmp_path, tok, mode):
    path = write(tmp_path, [row(), row(LONG)])
    full = PromptDataset(path, tok)[1].prompt_ids
    ds = PromptDataset(path, tok, max_prompt_length=48, truncation=mode)
    got = ds[1].prompt_ids
    expected = {"left": full[-48:], "right": full[:48], "middle": full[:24] + full[-24:]}[mode]
    assert got == expected and len(got) == 48
    assert ds[0].prompt_ids == PromptDataset(path, tok)[0].prompt_ids  # short prompts untouched
    assert ds.stats.truncated == 1 and ds.stats.filtered_overlong == 0


def test_truncate_helper():
    assert truncate([1, 2, 3, 4, 5], 3, "middle") == [1, 4, 5]
    assert truncate([1, 2], 3, "error") == [1, 2]
    with pytest.raises(ValueError, match="data.truncation"):
        truncate([1, 2, 3, 4], 3, "sideways")


def test_filter_overlong_prompts_drops_and_counts(tmp_path, tok):
    path = write(tmp_path, [row(LONG), row(), row(LONG), row("Repeat 'z' 1 times.", "z")])
    ds = PromptDataset(path, tok, max_prompt_length=48, filter_overlong_prompts=True)
    assert [it.ground_truth for it in ds] == ["abab", "z"] and [it.index for it in ds] == [0, 1]
    assert ds.stats.filtered_overlong == 2 and ds.stats.truncated == 0
    with pytest.raises(DataError, match="filtered as overlong: 2"):
        PromptDataset(write(tmp_path, [row(LONG)] * 2, "long.parquet"), tok, max_prompt_length=48,
                      filter_overlong_prompts=True)


def test_bad_settings(tmp_path, tok):
    path = write(tmp_path, [row()])
    with pytest.raises(ValueError, match="data.truncation='cut'"):
        PromptDataset(path, tok, truncation="cut")
    with pytest.raises(ValueError, match="data.max_prompt_length"):
        PromptDataset(path, tok, max_prompt_length=0)
    plain = build_char_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="custom_chat_template"):
        PromptDataset(path, plain)


def test_from_default_config_uses_builtin_task(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("VERL_ASYNC_CACHE", str(tmp_path / "cache"))
    data_cfg = OmegaConf.load(os.path.join(CONFIG_DIR, "data", "default.yaml"))
    train = PromptDataset.from_config(data_cfg, tok, "train")
    val = PromptDataset.from_config(data_cfg, tok, "val")
    assert (len(train), len(val)) == (builtin.SPLIT_SIZES["train"], builtin.SPLIT_SIZES["val"])
    assert max(train.prompt_lengths()) <= data_cfg.max_prompt_length
    assert train[0].data_source == builtin.DATA_SOURCE


# --- iterator -------------------------------------------------------------------------------

def _ids(draws):
    return [(d.epoch, d.item.index) for d in draws]


def items(n):
    return [type("Item", (), {"index": i})() for i in range(n)]


def test_iterator_epochs_without_shuffle():
    it = PromptIterator(items(3), shuffle=False, total_epochs=2)
    assert _ids(it) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert it.exhausted


def test_iterator_shuffles_per_epoch_deterministically():
    a = _ids(PromptIterator(items(50), seed=7, total_epochs=3))
    b = _ids(PromptIterator(items(50), seed=7, total_epochs=3))
    c = _ids(PromptIterator(items(50), seed=8, total_epochs=3))
    assert a == b and a != c
    epochs = [[i for e, i in a if e == k] for k in range(3)]
    assert all(sorted(ep) == list(range(50)) for ep in epochs)  # every prompt once per epoch
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(50))


@pytest.mark.parametrize("stop_after", [0, 1, 17, 49, 50, 51, 120])
def test_iterator_resumes_at_the_exact_prompt(stop_after):
    data = items(50)
    reference = _ids(PromptIterator(data, seed=3, total_epochs=3))
    first = PromptIterator(data, seed=3, total_epochs=3)
    head = [next(first) for _ in range(stop_after)]
    state = first.state_dict()
    resumed = PromptIterator(data, seed=123, shuffle=False, total_epochs=3)  # the state overrides seed/shuffle
    resumed.load_state_dict(state)
    assert _ids(head) + _ids(resumed) == reference


def test_iterator_uid_and_bad_state():
    it = PromptIterator(items(4), shuffle=False)
    draw = next(it)
    assert draw.uid == "0:0" and draw.position == 0
    state = it.state_dict()
    with pytest.raises(ValueError, match="taken over 4 prompts, the dataset now has 5"):
        PromptIterator(items(5)).load_state_dict(state)
    with pytest.raises(ValueError, match="empty"):
        PromptIterator([])
    infinite = PromptIterator(items(2), shuffle=False)
    assert _ids([next(infinite) for _ in range(5)]) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert not infinite.exhausted
