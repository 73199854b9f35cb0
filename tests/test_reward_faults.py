"""Reward functions that fail, and numbers of every numeric type: what the run does with them.

A scorer returning `np.float32(1.0)` (numpy-based scorers do) was rejected per response and
scored 0 everywhere; a scorer that always raised, or returned NaN, trained silently on zero
reward and the run ended with rc 0. Now any real number is a score (verl calls float()), and a
function failing on more than `reward_model.max_error_rate` of the last
`reward_model.error_window` responses stops the run with one line naming the function, the
error and a sample input.
"""

from __future__ import annotations

import asyncio
import textwrap
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.test_rollout_service_faults import _service, data_files  # noqa: F401 (a fixture)
from tests.test_rollouter import Sink
from tests.fakes import FakeEngine
from verl_async.pipeline import _summarise
from verl_async.protocol import Response, RolloutSample
from verl_async.queue import MessageQueue
from verl_async.reward import RewardFunctionError, build_reward_manager, to_score_dict
from verl_async.reward.error_rate import ErrorWindow
from verl_async.trainer.trainer import batch_metrics

SCORERS = textwrap.dedent(
    """
    import math
    import numpy as np
    import torch

    def always_raises(data_source, solution_str, ground_truth, extra_info=None):
        raise ValueError("boom: bad\\nanswer format")

    def returns_nan(data_source, solution_str, ground_truth, extra_info=None):
        return math.nan

    def returns_float32(data_source, solution_str, ground_truth, extra_info=None):
        return np.float32(1.0)

    def returns_tensor(data_source, solution_str, ground_truth, extra_info=None):
        return torch.tensor(0.5)

    def returns_bool(data_source, solution_str, ground_truth, extra_info=None):
        return True

    def by_text(data_source, solution_str, ground_truth, extra_info=None):
        return {"raise": None, "ok": 1.0}[solution_str]  # None is no number: a failure
    """
)


@pytest.fixture(scope="module")
def scorer_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("scorers") / "my_reward.py"
    path.write_text(SCORERS)
    return str(path)


# ---------------------------------------------------------------------------- numbers of every type
@pytest.mark.parametrize("raw,score,acc", [
    (np.float32(1.0), 1.0, 1.0), (np.float64(0.25), 0.25, 1.0), (np.int64(0), 0.0, 0.0), (np.bool_(True), 1.0, 1.0),
    (np.array(0.5), 0.5, 1.0), (torch.tensor(0.75), 0.75, 1.0), (torch.tensor(True), 1.0, 1.0), (True, 1.0, 1.0),
    (-2, -2.0, 0.0),
])
def test_any_real_number_is_a_score(raw, score, acc):
    assert to_score_dict(raw) == {"score": score, "acc": acc}


def test_dict_values_of_numpy_and_torch_types_are_kept():
    raw = {"score": np.float32(0.5), "acc": np.bool_(False), "len": torch.tensor(3), "pred": "12", "v": np.ones(2)}
    assert to_score_dict(raw) == {"score": 0.5, "acc": 0.0, "len": 3.0}


@pytest.mark.parametrize("raw,error,match", [
    ("1.0", TypeError, "scorer returned str"),
    (None, TypeError, "scorer returned NoneType"),
    ([1.0], TypeError, "scorer returned list"),
    (np.array([1.0, 0.0]), TypeError, r"ndarray of shape \(2,\)"),
    (torch.tensor([1.0]), TypeError, r"Tensor of shape \(1,\)"),
    ({"score": np.zeros(3)}, TypeError, r"ndarray of shape \(3,\)"),
    (np.float32("nan"), ValueError, "non-finite score nan"),
    (torch.tensor(float("inf")), ValueError, "non-finite score inf"),
])
def test_what_is_not_a_number_fails(raw, error, match):
    with pytest.raises(error, match=match):
        to_score_dict(raw)


# ---------------------------------------------------------------------------- the error window
def test_error_window_by_hand():
    w = ErrorWindow(0.25, 4)  # at most 1 failure among the last 4
    assert w.max_errors == 1
    assert [w.record(f) for f in (True, False, False, False)] == [False] * 4
    assert w.record(True) is False and w.errors == 1  # the first failure left the window
    assert w.record(True) is True and w.errors == 2 and len(w) == 4


@pytest.mark.parametrize("rate,window,max_errors", [(0.1, 200, 20), (0.29, 100, 29), (0.0, 5, 0), (1.0, 3, 3)])
def test_error_window_limit(rate, window, max_errors):
    w = ErrorWindow(rate, window)
    assert w.max_errors == max_errors
    trips = [w.record(True) for _ in range(window)]
    assert trips == [i + 1 > max_errors for i in range(window)]  # 1.0 never trips


@pytest.mark.parametrize("rate,window,key", [(1.5, 10, "reward_model.max_error_rate"), (0.1, 0, "reward_model.error_window")])
def test_error_window_config_errors_name_the_key(rate, window, key):
    with pytest.raises(ValueError, match=key):
        ErrorWindow(rate, window)


def test_manager_marks_each_failed_response_and_stops_when_too_many_fail(scorer_file):
    manager = build_reward_manager({"max_error_rate": 0.5, "error_window": 4},
                                   {"path": scorer_file, "name": "by_text"}, None)
    try:
        out = manager.score_texts(["ok", "raise", "ok", "raise"], [1] * 4, "src", "7")
        assert [r.reward for r in out] == [1.0, 0.0, 1.0, 0.0]
        assert [r.error for r in out] == [None, "TypeError: scorer returned NoneType, expected a number or a dict "
                                                "with 'score'", None, out[1].error]
        assert [r.info["reward_error"] for r in out] == [0.0, 1.0, 0.0, 1.0]
        assert [r.info.get("acc") for r in out] == [1.0, None, 1.0, None]  # failed: no answer, right or wrong
        with pytest.raises(RewardFunctionError) as info:  # 3 failures among the last 4: more than 0.5 x 4
            manager.score_texts(["raise"], [1], "src", "7")
        assert manager.summary() == {"reward_scored": 5, "reward_errors": 3}
    finally:
        manager.close()
    message = str(info.value)
    assert message.startswith(f"reward function {scorer_file}:by_text failed on 3 of the last 4 scored responses "
                              "(more than reward_model.max_error_rate=0.5 of reward_model.error_window=4): TypeError")
    assert "sample input: data_source='src', ground_truth='7', solution_str='raise'" in message


def test_a_slow_import_of_the_reward_module_is_not_charged_to_the_first_response(tmp_path):
    # A module importing torch took ~3 s, more than reward_model.timeout_s on a loaded machine: the first
    # response of every (replacement) worker timed out. Workers now import it before they are ready.
    path = tmp_path / "slow_import.py"
    path.write_text("import time\ntime.sleep(2.0)\n\ndef f(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return 1.0\n")
    manager = build_reward_manager({"timeout_s": 1.0}, {"path": str(path), "name": "f"}, None)
    try:
        out = manager.score_texts(["a", "b"], [1, 1], "src", "x")
    finally:
        manager.close()
    assert [(r.reward, r.error) for r in out] == [(1.0, None), (1.0, None)]


# ---------------------------------------------------------------------------- through the Rollouter
def _rollout(tmp_path, model_dir, files, scorer_file: str, name: str):
    """The Rollouter of a RolloutService over 8 prompts x 2 responses, scored by `name`; (service, groups)."""
    svc = _service(tmp_path, model_dir, files, [FakeEngine(max_len=6)], f"custom_reward_function.path={scorer_file}",
                   f"custom_reward_function.name={name}", "reward_model.max_error_rate=0.25",
                   "reward_model.error_window=8", "reward_model.timeout_s=60")  # no timeouts on a loaded CI machine
    queue = MessageQueue(capacity=64, group_size=2)
    svc.rollouter.sink = Sink(queue)
    svc.rollouter.budget.limit = 64  # no trainer here: nothing would sync

    async def go():
        await asyncio.wait_for(svc.rollouter.run(), 60)
        return await queue.get_batch(queue.size(), timeout=1)

    try:
        return svc, asyncio.run(go())
    finally:
        svc.reward.close()


@pytest.mark.parametrize("name,error", [
    ("always_raises", r"ValueError: boom: bad answer format"),  # the message's newline is folded: one line
    ("returns_nan", r"ValueError: scorer returned a non-finite score nan"),
])
def test_failing_reward_function_stops_the_rollout_with_one_line(tmp_path, tiny_model_dir, data_files, scorer_file,
                                                                 name, error):
    with pytest.raises(RewardFunctionError) as info:
        _rollout(tmp_path, tiny_model_dir, data_files, scorer_file, name)
    message = str(info.value)
    assert "\n" not in message
    # 0.25 x 8: the third failure stops the run, in the second group
    assert message.startswith(f"reward function {scorer_file}:{name} failed on 3 of the last 3 scored responses "
                              f"(more than reward_model.max_error_rate=0.25 of reward_model.error_window=8): ")
    assert f"): {error}; sample input: data_source='verl_async/builtin_repeat', ground_truth=" in message
    assert "solution_str='" in message and message.endswith("raise reward_model.max_error_rate (1.0 turns this "
                                                            "check off)")


@pytest.mark.parametrize("name,reward", [("returns_float32", 1.0), ("returns_tensor", 0.5), ("returns_bool", 1.0)])
def test_numpy_tensor_and_bool_scores_are_accepted(tmp_path, tiny_model_dir, data_files, scorer_file, name, reward):
    svc, groups = _rollout(tmp_path, tiny_model_dir, data_files, scorer_file, name)
    assert len(groups) == 8
    assert {r.reward for g in groups for r in g.responses} == {reward}
    assert all(r.reward_info["reward_error"] == 0.0 for g in groups for r in g.responses)
    assert svc.reward.summary() == {"reward_scored": 16, "reward_errors": 0}


def test_failed_scores_are_not_wrong_answers_in_the_training_accuracy():
    ok = Response(token_ids=[1], log_probs=[0.0], versions=[0], finish_reason="stop", reward=1.0,
                  reward_info={"score": 1.0, "acc": 1.0, "reward_error": 0.0})
    failed = replace(ok, reward=0.0, reward_info={"score": 0.0, "reward_error": 1.0})
    group = RolloutSample(uid="0:0", prompt_ids=[1], responses=[ok, failed])
    metrics = batch_metrics([group], version=0, max_response_length=4)
    assert metrics["critic/acc/mean"] == 1.0 and metrics["critic/score/mean"] == 0.5


def test_end_of_run_summary_counts_failed_scores(tmp_path, capsys):
    summary = _summarise(str(tmp_path), {"rollouter": {"reward_errors": 3, "reward_scored": 16},
                                         "trainer": {"steps": 2}}, {}, {}, 1.0)
    assert summary["rollout/reward_errors"] == 3
    assert ("warning: the reward function failed on 3 of 16 scored responses (scored 0; the first failures are in "
            "the log; reward_model.max_error_rate)") in capsys.readouterr().out


@pytest.mark.slow
def test_run_with_an_always_raising_reward_function_fails_with_one_line(ray_session, tmp_path, tiny_model_dir,
                                                                       scorer_file):
    """The CLI end to end: it trained on zero reward and exited 0; now it stops, exit 1, with the one line."""
    from tests.test_fault_injection import run_failing
    from verl_async.data import builtin, write_rows

    train = str(tmp_path / "train.parquet")
    write_rows(builtin.generate_rows("train", 8, seed=3), train)
    proc, _ = run_failing(tmp_path, tiny_model_dir, (train, train), "null", "trainer.val_before_train=false",
                          f"custom_reward_function.path={scorer_file}", "custom_reward_function.name=always_raises",
                          "reward_model.max_error_rate=0.25", "reward_model.error_window=8")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("run failed: "))
    assert line.startswith(f"run failed: the rollouter failed: RewardFunctionError: reward function "
                           f"{scorer_file}:always_raises failed on 3 of the last 3 scored responses")
    assert "ValueError: boom: bad answer format; sample input: data_source='verl_async/builtin_repeat'" in line
