"""data.custom_cls: loading a user's dataset class (one-line errors naming the key and file), its row mapping, and
ReTool's class (recipe/retool/retool.py) over rows shaped like DAPO-Math-17k and AIME."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from verl_async.config import ConfigError, compose, validate
from verl_async.config.cli import REPO_ROOT
from verl_async.config.preflight import load_prompts
from verl_async.data import (DataError, DatasetClassError, PromptDataset, RLHFDataset, dataset_from_config,
                             load_dataset_class)
from verl_async.models.tiny import build_char_tokenizer

RETOOL = str(REPO_ROOT / "recipe" / "retool" / "retool.py")
ANSWER_FORMAT = "\nThe answer format must be: \\boxed{'The final answer goes here.'}"
DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def dapo_row(q: str, answer: str, index: str) -> dict:
    """One row as BytedTsinghua-SIA/DAPO-Math-17k ships it."""
    return {"data_source": "math_dapo", "prompt": [{"content": DAPO_PROMPT.format(q=q), "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index}}


def write(path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def user_file(tmp_path, body: str, name: str = "my_data.py") -> str:
    path = tmp_path / name
    path.write_text("from verl_async.data import RLHFDataset\n\n" + body)
    return str(path)


def data_cfg(train, val=None, path=None, name=None, **extra) -> dict:
    return {"train_files": train, "val_files": val, "custom_cls": {"path": path, "name": name}, **extra}


# --------------------------------------------------------------------------- the loader
def test_no_path_is_the_plain_dataset():
    assert load_dataset_class(None, None) is PromptDataset and load_dataset_class(None, "Ignored") is PromptDataset


@pytest.mark.parametrize("body,name,line", [
    ("", None, "data.custom_cls.name: not set; name the dataset class in {path}"),
    ("raise RuntimeError('boom')\n", "D", "data.custom_cls.path: {path}: importing it failed: RuntimeError('boom')"),
    ("class D(RLHFDataset):\n    pass\n", "Other", "data.custom_cls.name: no class 'Other' in {path}"),
    ("D = 3\n", "D", "data.custom_cls.name: no class 'D' in {path}"),
    ("class D:\n    def __len__(self):\n        return 0\n", "D",
     "data.custom_cls.name: D in {path} is not a subclass of verl_async.data.RLHFDataset (subclass it and override "
     "map_fn)"),
    ("class D(RLHFDataset):\n    def _read_files_and_tokenize(self):\n        pass\n", "D",
     "data.custom_cls.name: D in {path} defines _read_files_and_tokenize, which verl_async never calls; map each row "
     "in map_fn(row, *, file) (and read files in read_file)"),
    ("class Base(RLHFDataset):\n    def __getitem__(self, i):\n        return i\n\nclass D(Base):\n    pass\n", "D",
     "data.custom_cls.name: D in {path} defines __getitem__, which verl_async never calls; map each row in "
     "map_fn(row, *, file) (and read files in read_file)"),
])
def test_loader_errors_name_the_key_and_the_file(tmp_path, body, name, line):
    path = user_file(tmp_path, body)
    with pytest.raises(DatasetClassError) as err:
        load_dataset_class(path, name)
    assert str(err.value) == line.format(path=path)


def test_missing_file(tmp_path):
    with pytest.raises(DatasetClassError) as err:
        load_dataset_class(str(tmp_path / "nope.py"), "D")
    assert (err.value.key, err.value.reason) == ("data.custom_cls.path", f"no such file: {tmp_path / 'nope.py'}")


def test_a_file_is_executed_once_for_every_dataset_and_the_reward_function(tmp_path, tok):
    from verl_async.reward.registry import custom_scorer_ref

    count = tmp_path / "imports.txt"
    path = user_file(tmp_path, f"open({str(count)!r}, 'a').write('x')\n\nclass D(RLHFDataset):\n    pass\n\n"
                               "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    train = write(tmp_path / "t.parquet", [dapo_row("1+1?", "2", "a")])
    cfg = data_cfg(train, train, path, "D")
    datasets = [dataset_from_config(cfg, tok, split) for split in ("train", "val")]
    assert custom_scorer_ref(path, "score").load()(None, "", "") == 0.0
    assert type(datasets[0]) is type(datasets[1]) is load_dataset_class(path, "D")
    assert count.read_text() == "x"


# --------------------------------------------------------------------------- the protocol
MAPPER = """
class D(RLHFDataset):
    def map_fn(self, row, *, file):
        if row["q"] == "drop":
            return None
        if row["q"] == "bad":
            raise KeyError("answer")
        return {"data_source": "src", "prompt": [{"role": "user", "content": row["q"]}],
                "reward_model": {"ground_truth": row["a"]}, "extra_info": {"file": file}}
"""


def test_map_fn_maps_drops_and_reports_bad_rows(tmp_path, tok):
    train = write(tmp_path / "raw.parquet", [{"q": "What is 2+3?", "a": "5"}, {"q": "drop", "a": ""},
                                               {"q": "bad", "a": ""}])
    cfg = data_cfg(train, path=user_file(tmp_path, MAPPER), name="D")
    ds = dataset_from_config(cfg, tok)
    assert len(ds) == 1 and (ds.stats.rows_read, ds.stats.dropped, ds.stats.bad_rows) == (3, 1, 1)
    item = ds[0]
    assert (item.messages, item.ground_truth, item.data_source) == (
        [{"role": "user", "content": "What is 2+3?"}], "5", "src")
    assert item.extra_info == {"file": train} and item.source == f"{train}:0"
    assert ds.stats.bad_row_examples[0].reason == "D.map_fn failed: KeyError('answer')"
    with pytest.raises(DataError, match=r"raw.parquet: row 2: D.map_fn failed: KeyError\('answer'\) "
                                        r"\(data.skip_bad_rows=false\)"):
        dataset_from_config({**cfg, "skip_bad_rows": False}, tok)


def test_read_file_reads_another_format(tmp_path, tok):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"q": "What is 2+3?", "a": "5"}\n{"q": "What is 1+1?", "a": "2"}\n')
    body = MAPPER + "\n    def read_file(self, path):\n        import pyarrow.json\n\n" \
                    "        return pyarrow.json.read_json(path)\n"
    ds = dataset_from_config(data_cfg(str(jsonl), path=user_file(tmp_path, body), name="D"), tok)
    assert [item.ground_truth for item in ds] == ["5", "2"]


def test_a_mapped_row_is_checked_like_a_file_row(tmp_path, tok):
    body = "class D(RLHFDataset):\n    def map_fn(self, row, *, file):\n        return {'prompt': 'not messages'}\n"
    train = write(tmp_path / "raw.parquet", [{"q": "x"}])
    cfg = data_cfg(train, path=user_file(tmp_path, body), name="D", skip_bad_rows=False)
    with pytest.raises(DataError, match="raw.parquet: row 0: prompt is not a non-empty list of {role, content} messages"):
        dataset_from_config(cfg, tok)


# --------------------------------------------------------------------------- the config and the preflight
def test_validation_checks_the_keys_and_makes_the_path_absolute(tmp_path, monkeypatch):
    path = user_file(tmp_path, "class D(RLHFDataset):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    cfg = validate(compose("fully_async_ppo_trainer", ["data.custom_cls.path=my_data.py", "data.custom_cls.name=D"]))
    assert cfg.data.custom_cls.path == path
    for overrides, line in [
        (["data.custom_cls.path=nope.py"], f"data.custom_cls.path: no such file: nope.py (relative to {tmp_path})"),
        (["data.custom_cls.path=my_data.py"], "data.custom_cls.name: not set; name the dataset class in my_data.py"),
    ]:
        with pytest.raises(ConfigError) as err:
            validate(compose("fully_async_ppo_trainer", overrides))
        assert str(err.value) == line


def test_preflight_loads_the_class_and_names_the_key(tmp_path, tok):
    path = user_file(tmp_path, "class D(RLHFDataset):\n    pass\n")
    train = write(tmp_path / "t.parquet", [dapo_row("1+1?", "2", "a")])
    cfg = OmegaConf.create({"data": data_cfg(train, path=path, name="D"),
                            "actor_rollout_ref": {"model": {"path": "m"}, "rollout": {"multi_turn": {"enable": False}}}})
    assert type(load_prompts(cfg, tok, "train")).__name__ == "D"
    cfg.data.custom_cls.name = "Missing"
    with pytest.raises(ConfigError) as err:
        load_prompts(cfg, tok, "train")
    assert str(err.value) == f"data.custom_cls.name: no class 'Missing' in {path}"


# --------------------------------------------------------------------------- ReTool's class
def test_retool_dataset_maps_dapo_math_17k_rows(tmp_path, tok):
    train = write(tmp_path / "dapo-math-17k.parquet",
                  [dapo_row("What is 6 * 12?", "72", "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"),
                   dapo_row("What is 2 ** 5?", "32", "b426d104-244d-4831-a2c4-cd756b61700a")])
    ds = dataset_from_config(data_cfg(train, path=RETOOL, name="CustomRLHFDataset"), tok)
    assert len(ds) == 2 and ds.stats.bad_rows == 0
    item = ds[0]
    assert item.messages == [{"role": "user", "content": DAPO_PROMPT.format(q="What is 6 * 12?") + ANSWER_FORMAT}]
    assert (item.data_source, item.ground_truth, item.ability, item.agent_name) == ("math_dapo", "72", "MATH",
                                                                                   "tool_agent")
    assert item.extra_info == {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"}
    assert item.raw_prompt.endswith(ANSWER_FORMAT + "<|im_end|>\n<|im_start|>assistant\n")


def test_retool_dataset_maps_aime_rows(tmp_path, tok):
    aime24 = write(tmp_path / "Maxwell-Jia" / "AIME_2024" / "aime_2024_problems.parquet",
                   [{"ID": "2024-I-1", "Problem": "Find x.", "Solution": "...", "Answer": 204}])
    aime25 = write(tmp_path / "yentinglin" / "aime_2025" / "train.parquet",
                   [{"id": 0, "problem": "Find y.", "solution": "...", "answer": "70", "url": "u", "year": 2025}])
    ds = dataset_from_config(data_cfg(train=[aime25, aime24], path=RETOOL, name="CustomRLHFDataset"), tok)
    assert [(i.data_source, i.ground_truth, i.messages[0]["content"], i.agent_name) for i in ds] == [
        ("aime_2025", "70", "Find y." + ANSWER_FORMAT, "tool_agent"),
        ("aime_2024", "204", "Find x." + ANSWER_FORMAT, "tool_agent")]


def test_retool_dataset_reports_a_row_of_another_shape(tmp_path, tok):
    train = write(tmp_path / "other.parquet", [{"question": "q", "label": "a"}])
    cfg = data_cfg(train, path=RETOOL, name="CustomRLHFDataset", skip_bad_rows=False)
    with pytest.raises(DataError, match=r"other.parquet: row 0: CustomRLHFDataset.map_fn failed: ValueError\(\"neither "
                                        r"a verl row \(prompt messages\) nor an AIME row \(problem, answer\); columns: "
                                        r"\['label', 'question'\]\"\)"):
        dataset_from_config(cfg, tok)
