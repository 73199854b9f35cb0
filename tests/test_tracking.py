"""trainer.logger backends (fakes stand in for wandb, mlflow and swanlab) and trainer.log_val_generations."""

from __future__ import annotations

import asyncio
import glob
import importlib.machinery
import json
import sys
import types

import numpy as np
import pytest

from tests.test_rollout_service_faults import _service, data_files  # noqa: F401 (a fixture)
from tests.fakes import FakeEngine
from verl_async.config import ConfigError, compose, validate
from verl_async.config.preflight import check_loggers
from verl_async.utils import tracking_backends as backends
from verl_async.utils.tracking import SUPPORTED_LOGGERS, Tracker, logger_problem
from verl_async.utils.val_generations import (
    VAL_GENERATIONS_KEY,
    format_val_generations,
    val_generations,
    val_sample_order,
)

SAMPLES = [{"input": "What is 2+2?", "output": "4", "score": 1.0}, {"input": "3*3?", "output": "6", "score": 0.0}]


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec answers from sys.modules
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


@pytest.fixture
def calls(monkeypatch):
    """Fake wandb, mlflow and swanlab modules recording every call as (module.function, args, kwargs)."""
    log: list = []

    def rec(name, result=None):
        def fn(*args, **kwargs):
            log.append((name, args, kwargs))
            return result
        return fn

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    wandb = _module("wandb", init=rec("wandb.init", "run"), log=rec("wandb.log"), finish=rec("wandb.finish"), Table=Table)
    mlflow = _module("mlflow", set_tracking_uri=rec("mlflow.set_tracking_uri"),
                     set_experiment=rec("mlflow.set_experiment", types.SimpleNamespace(experiment_id="7")),
                     start_run=rec("mlflow.start_run"), log_params=rec("mlflow.log_params"),
                     log_metrics=rec("mlflow.log_metrics"), log_dict=rec("mlflow.log_dict"), end_run=rec("mlflow.end_run"))
    swanlab = _module("swanlab", login=rec("swanlab.login"), init=rec("swanlab.init"), log=rec("swanlab.log"),
                      finish=rec("swanlab.finish"), Text=lambda text: ("Text", text))
    for mod in (wandb, mlflow, swanlab):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    for var in ("WANDB_ENTITY", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "SWANLAB_API_KEY", "VERL_FILE_LOGGER_PATH"):
        monkeypatch.delenv(var, raising=False)
    return log


# --------------------------------------------------------------------------- names
def test_backends_cover_the_supported_names():
    assert tuple(backends.BACKENDS) == SUPPORTED_LOGGERS


@pytest.mark.parametrize("logger,line", [
    ("[console,clearml]", "trainer.logger: clearml is a verl logger that verl_async does not support; use any of: "
                          "console, tensorboard, wandb, mlflow, swanlab, file"),
    ("[nope]", "trainer.logger: unknown logger 'nope'; expected any of: console, tensorboard, wandb, mlflow, swanlab, file"),
])
def test_unsupported_loggers_are_refused_in_one_line(logger, line):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides=[f"trainer.logger={logger}"]))
    assert str(err.value) == line


def test_verl_logger_names_are_accepted():
    cfg = validate(compose(overrides=["trainer.logger=[console,tracking,file,mlflow,swanlab,wandb]"]))
    assert list(cfg.trainer.logger) == ["console", "wandb", "file", "mlflow", "swanlab"]  # tracking: verl's old wandb
    assert logger_problem("tensorboard") is None


def test_preflight_names_a_missing_package(tmp_path, monkeypatch):
    cfg = validate(compose(overrides=["trainer.logger=[console,mlflow]"]))
    if "mlflow" in sys.modules or importlib.util.find_spec("mlflow") is not None:
        pytest.skip("mlflow is installed here")
    with pytest.raises(ConfigError) as err:
        check_loggers(cfg)
    assert str(err.value) == ("trainer.logger: mlflow needs the mlflow package, which is not installed: "
                              "pip install mlflow (or remove mlflow from trainer.logger)")
    (tmp_path / "mlflow").mkdir()
    (tmp_path / "mlflow" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_loggers(cfg)  # installed: passes


# --------------------------------------------------------------------------- backends
def test_wandb_mlflow_swanlab_get_metrics_and_generations(calls, tmp_path):
    tr = Tracker(["wandb", "mlflow", "swanlab"], str(tmp_path / "tb"), project="p", experiment="e",
                 config={"trainer": {"logger": ["wandb"]}, "lr": 1e-6})
    tr.log({"val/mean@4/acc": 0.5, "loss": float("nan"), "note": "text"}, step=3)
    tr.log_generations(SAMPLES, step=3)
    tr.close()
    by_name = {}
    for name, args, kwargs in calls:
        by_name.setdefault(name, []).append((args, kwargs))
    assert by_name["wandb.init"] == [((), {"project": "p", "name": "e", "entity": None,
                                           "config": {"trainer": {"logger": ["wandb"]}, "lr": 1e-6}})]
    metrics_call, table_call = by_name["wandb.log"]
    assert metrics_call[0][0]["val/mean@4/acc"] == 0.5 and np.isnan(metrics_call[0][0]["loss"])
    table = table_call[0][0][VAL_GENERATIONS_KEY]
    assert table.columns == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert table.data == [[3, "What is 2+2?", "4", 1.0, "3*3?", "6", 0.0]]
    assert by_name["mlflow.set_tracking_uri"] == [(("sqlite:////tmp/mlruns.db",), {})]
    assert by_name["mlflow.start_run"] == [((), {"experiment_id": "7", "run_name": "e"})]
    assert by_name["mlflow.log_params"] == [(({"trainer/logger/0": "wandb", "lr": 1e-6},), {})]
    # MLflow: finite values only, '@' spelled out (verl's rule)
    assert by_name["mlflow.log_metrics"] == [(({"val/mean_at_4/acc": 0.5},), {"step": 3})]
    assert by_name["mlflow.log_dict"] == [((SAMPLES, "val_generations/step_3.json"), {})]
    swan_metrics, swan_text = by_name["swanlab.log"]
    assert swan_text[0][0][VAL_GENERATIONS_KEY] == ("Text", format_val_generations(SAMPLES, 3))
    assert {n for n in by_name if n.endswith(("finish", "end_run"))} == {"wandb.finish", "swanlab.finish", "mlflow.end_run"}


def test_wandb_keeps_a_late_validation_at_the_current_step_with_its_version(calls, tmp_path):
    """wandb drops a log at a step lower than one it has seen; a validation finished beside later steps is one."""
    tr = Tracker(["wandb"], str(tmp_path / "tb"), project="p", experiment="e", config={})
    tr.log({"actor/pg_loss": 0.1}, step=5)
    tr.log({"val/mean@1/acc": 0.4}, step=4)
    tr.log_generations(SAMPLES, step=4)
    logs = [(args[0], kwargs) for name, args, kwargs in calls if name == "wandb.log"]
    assert logs[0] == ({"actor/pg_loss": 0.1}, {"step": 5})
    assert logs[1] == ({"val/mean@1/acc": 0.4, "val/step": 4.0}, {})
    assert logs[2][1] == {} and logs[2][0]["val/step"] == 4.0 and VAL_GENERATIONS_KEY in logs[2][0]


def test_file_logger_writes_verl_jsonl(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    tr = Tracker(["file"], str(tmp_path / "tb"), file_path=str(tmp_path / "run" / "metrics.jsonl"))
    tr.log({"a": 1, "flag": True, "bad": float("inf"), "skip": "x"}, step=2)
    tr.log_generations(SAMPLES[:1], step=2)
    tr.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 2, "data": {"a": 1.0, "flag": 1.0, "bad": None}},
                     {"step": 2, "data": {VAL_GENERATIONS_KEY: SAMPLES[:1]}}]
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "elsewhere.jsonl"))  # verl's variable wins
    tr = Tracker(["file"], str(tmp_path / "tb"))
    tr.log({"a": 2}, step=5)
    tr.close()
    assert json.loads((tmp_path / "elsewhere.jsonl").read_text()) == {"step": 5, "data": {"a": 2.0}}


def test_console_and_tensorboard_show_generations(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    long = {"input": "q" * 2500, "output": "a", "score": 0.5}
    tr = Tracker(["console", "tensorboard"], str(tmp_path))
    tr.log_generations([SAMPLES[0], long], step=4)
    tr.close()
    out = capsys.readouterr().out
    assert "**Generation Results - Step 4**" in out and "**Input:** What is 2+2?" in out and "**Score:** 1.0" in out
    assert "q" * 2000 + "... (500 more characters)" in out and "q" * 2001 not in out
    acc = EventAccumulator(glob.glob(str(tmp_path / "events*"))[0], size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors(f"{VAL_GENERATIONS_KEY}/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 4 and text == format_val_generations([SAMPLES[0], long], 4) and "q" * 2500 in text


def test_format_val_generations_is_verls_text():
    assert format_val_generations(SAMPLES[:1], 7) == (
        "**Generation Results - Step 7**\n\n### Sample 1\n**Input:** What is 2+2?\n\n**Output:** 4\n\n"
        "**Score:** 1.0\n\n---\n\n")


# --------------------------------------------------------------------------- which samples
def test_val_sample_order_is_verls_choice():
    # verl: sort (input, ...) by input, RandomState(42).shuffle, first n -> [('a', 3), ('d', 4), ('b', 0), ...]
    assert val_sample_order(["b", "a", "c", "a", "d"], 3) == [3, 4, 0]
    inputs = [f"prompt {i % 7}" for i in range(40)]
    samples = sorted(((x, i) for i, x in enumerate(inputs)), key=lambda s: s[0])
    np.random.RandomState(42).shuffle(samples)
    assert val_sample_order(inputs, 10) == [i for _, i in samples[:10]]
    assert val_sample_order(inputs, 0) == [] and len(val_sample_order(inputs, 100)) == 40


def test_val_generations_decodes_only_what_it_shows():
    class Tok:
        def __init__(self):
            self.decoded = 0

        def batch_decode(self, seqs, skip_special_tokens):
            assert skip_special_tokens
            self.decoded += len(seqs)
            return ["".join(chr(96 + t) for t in s) for s in seqs]

    tok = Tok()
    out = val_generations(tok, [[2], [1], [3], [1], [4]], [[5], [6], [7], [8], [9]], [0.1, 0.2, 0.3, 0.4, 0.5], 3)
    assert out == [{"input": "a", "output": "h", "score": 0.4}, {"input": "d", "output": "i", "score": 0.5},
                   {"input": "b", "output": "e", "score": 0.1}]
    assert tok.decoded == 5 + 3
    with pytest.raises(ValueError, match="2 prompts, 1 responses"):
        val_generations(tok, [[1], [2]], [[1]], [0.0, 1.0], 1)


def test_validation_hands_back_n_generations(tmp_path, tiny_model_dir, data_files):  # noqa: F811
    svc = _service(tmp_path, tiny_model_dir, data_files, [FakeEngine(max_len=4)], "trainer.log_val_generations=5")
    off = _service(tmp_path / "off", tiny_model_dir, data_files, [FakeEngine(max_len=4)])
    try:
        out, plain = asyncio.run(svc.validate(0)), asyncio.run(off.validate(0))
    finally:
        svc.reward.close()
        off.reward.close()
    shown = out.pop(VAL_GENERATIONS_KEY)
    assert VAL_GENERATIONS_KEY not in plain and set(out) == set(plain)
    prompts = {svc.tokenizer.decode(item.prompt_ids, skip_special_tokens=True) for item in svc.val_dataset}
    assert len(shown) == 5 and all(s["input"] in prompts and isinstance(s["score"], float) for s in shown)
    assert all(set(s) == {"input", "output", "score"} for s in shown)
