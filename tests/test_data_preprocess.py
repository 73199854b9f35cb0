"""gsm8k / MATH preprocessors on local fixtures shaped like the hub and repo exports."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from data_preprocess import gsm8k, math_dataset
from verl_async.data import PromptDataset
from verl_async.models.tiny import build_char_tokenizer
from verl_async.reward import default_compute_score

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def read(path):
    return pq.read_table(path).to_pylist()


@pytest.mark.parametrize("layout", ["gsm8k_hub", "gsm8k_jsonl"])
def test_gsm8k_schema_and_content(tmp_path, layout):
    out = gsm8k.main(["--local_dir", str(tmp_path), "--local_dataset_path", os.path.join(FIXTURES, layout)])
    assert out == {"train": str(tmp_path / "train.parquet"), "test": str(tmp_path / "test.parquet")}
    train, test = read(out["train"]), read(out["test"])
    assert len(train) == 4 and len(test) == 2  # hub layout: main/ wins over socratic/
    assert pq.read_schema(out["train"]).names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    first = train[0]
    question = (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?"
    )
    assert first == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {
            "split": "train",
            "index": 0,
            "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
            "altogether in April and May.\n#### 72",
            "question": question,
        },
    }
    assert [r["reward_model"]["ground_truth"] for r in train] == ["72", "10", "5", "5000"]  # "5,000" -> "5000"
    assert [r["reward_model"]["ground_truth"] for r in test] == ["18", "3"]
    assert [r["extra_info"]["index"] for r in test] == [0, 1] and {r["extra_info"]["split"] for r in test} == {"test"}
    assert all(r["prompt"][0]["content"].endswith(GSM8K_INSTRUCTION) for r in train + test)


def test_gsm8k_single_file_and_dataset_round_trip(tmp_path):
    out = gsm8k.main(["--local_save_dir", str(tmp_path), "--local_dataset_path",
                      os.path.join(FIXTURES, "gsm8k_jsonl", "test.jsonl")])
    assert list(out) == ["test"]
    ds = PromptDataset(out["test"], build_char_tokenizer(), max_prompt_length=512)
    assert len(ds) == 2 and ds[0].raw_prompt.endswith(GSM8K_INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n")
    for item in ds:  # the stored ground truth is what the scorer compares against
        answer = item.extra_info["answer"]
        assert default_compute_score(item.data_source, answer, item.ground_truth)["score"] == 1.0


@pytest.mark.parametrize("layout", ["math_hub", "math_jsonl"])
def test_math_schema_and_content(tmp_path, layout):
    out = math_dataset.main(["--local_dir", str(tmp_path), "--local_dataset_path", os.path.join(FIXTURES, layout)])
    train, test = read(out["train"]), read(out["test"])
    assert pq.read_schema(out["train"]).names == [
        "level", "type", "data_source", "prompt", "ability", "reward_model", "extra_info"
    ]
    assert train[1] == {
        "level": "Level 1",
        "type": "Prealgebra",
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": "Simplify $\\frac{84}{144}.$ " + MATH_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "\\frac{7}{12}"},
        "extra_info": {"split": "train", "index": 1},
    }
    assert [r["reward_model"]["ground_truth"] for r in train] == [
        "12", "\\frac{7}{12}", "\\left( 3, \\frac{\\pi}{2} \\right)", "2"  # nested braces, \fbox
    ]
    assert [r["reward_model"]["ground_truth"] for r in test] == ["-7", "[2,\\infty)"]
    for r in train + test:
        truth = r["reward_model"]["ground_truth"]
        assert default_compute_score(r["data_source"], f"So the answer is $\\boxed{{{truth}}}$.", truth)["acc"] == 1.0


def run_cli(module, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    return exc.value.code, capsys.readouterr().err


def test_no_hub_and_no_local_path_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    code, err = run_cli(gsm8k, ["--local_dir", str(tmp_path)], capsys)
    assert code == 2 and "cannot load 'openai/gsm8k' from the HF hub" in err and "--local_dataset_path" in err
    assert "Traceback" not in err


def test_bad_inputs_name_the_problem(tmp_path, capsys):
    code, err = run_cli(gsm8k, ["--local_dir", str(tmp_path), "--local_dataset_path", str(tmp_path / "nope")], capsys)
    assert code == 2 and "no such file or folder" in err
    bad = tmp_path / "raw" / "train.jsonl"
    bad.parent.mkdir()
    bad.write_text('{"question": "1+1?", "answer": "2"}\n')
    code, err = run_cli(gsm8k, ["--local_dir", str(tmp_path), "--local_dataset_path", str(bad.parent)], capsys)
    assert code == 2 and "train row 0" in err and "'#### <number>'" in err
    bad.write_text('{"problem": "1+1?", "solution": "It is 2."}\n')
    code, err = run_cli(math_dataset, ["--local_dir", str(tmp_path), "--local_dataset_path", str(bad)], capsys)
    assert code == 2 and "train row 0" in err and "boxed" in err
    bad.write_text("not json\n")
    code, err = run_cli(gsm8k, ["--local_dir", str(tmp_path), "--local_dataset_path", str(bad)], capsys)
    assert code == 2 and "train.jsonl: line 1: not JSON" in err
    odd = tmp_path / "questions.jsonl"
    odd.write_text("{}\n")
    code, err = run_cli(gsm8k, ["--local_dir", str(tmp_path), "--local_dataset_path", str(odd)], capsys)
    assert code == 2 and "cannot tell the split" in err
