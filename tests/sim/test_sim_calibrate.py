"""Calibration from run-dir logs and prediction of another run's wall time (fake runs)."""

import json
from dataclasses import replace

import pytest
from fake_run import make_fake_run, truth_config

from verl_async.sim import PDSRConfig, StepLatencySpeed, TableSpeed
from verl_async.sim.calibrate import (Calibration, calibrate, measured_wall, predict, run_settings,
                                      verl_config)
from verl_async.sim.runlog import RunLogError, read_lengths, read_timeline

TRUE_SPEED = StepLatencySpeed(0.02, 0.0004)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    d = tmp_path_factory.mktemp("runA")
    make_fake_run(d, truth_config(speed=TRUE_SPEED), "async", groups=96, seed=0)
    return d


def test_calibration_recovers_the_generating_model(run_a):
    cal = calibrate(run_a)
    assert cal.c0 == pytest.approx(0.02, rel=0.02)
    assert cal.c1 == pytest.approx(0.0004, rel=0.02)
    assert cal.train_a == pytest.approx(3.0, rel=1e-6)
    assert cal.train_b == pytest.approx(4e-5, rel=1e-6)
    assert cal.sync_time == pytest.approx(1.5)
    assert cal.replicas == 2
    assert 1 < cal.max_concurrency <= 48
    assert cal.details["rel_err_rms"] < 0.01
    assert cal.details["speed_table"]


def test_calibration_file_roundtrip(run_a, tmp_path):
    cal = calibrate(run_a)
    cal.save(tmp_path / "cal.json")
    assert Calibration.load(tmp_path / "cal.json") == cal
    (tmp_path / "bad.json").write_text("{\"c0\": 1}")
    with pytest.raises(ValueError, match="not a calibration file"):
        Calibration.load(tmp_path / "bad.json")


def test_run_settings_read_config_and_logs(run_a):
    s = run_settings(run_a)
    assert (s["n"], s["ppo_mini_batch_size"], s["staleness_threshold"]) == (4, 8, 0.5)
    assert (s["trigger_parameter_sync_step"], s["partial_rollout"], s["replicas"]) == (1, True, 2)
    assert "dispatch" not in s
    cfg = replace(truth_config(), dispatch="pdsr", replicas=3,
                  pdsr=PDSRConfig(offload_ratio=0.3, cap_factor=2.0, restart=True))
    lt = verl_config(cfg)["async_training"]["long_tail"]
    assert lt == {"enable": True, "offload_ratio": 0.3, "cap_factor": 2.0, "cap_mode": "l_cut",
                  "heavy_replicas": 1, "fast_max_num_seqs": None, "restart": True, "batch_size": None}


def test_predict_another_run_same_model(run_a, tmp_path):
    # run B differs in workload seed, replicas, staleness, trigger and partial rollout
    truth_b = truth_config(speed=TRUE_SPEED, replicas=3, staleness_threshold=0.2,
                           trigger_parameter_sync_step=2, partial_rollout=False)
    make_fake_run(tmp_path, truth_b, "async", groups=80, seed=5)
    out = predict(calibrate(run_a), tmp_path)
    wall, steps = measured_wall(tmp_path)
    assert (out["measured_wall"], out["steps"]) == (wall, steps)
    assert steps == 80 // 8
    assert abs(out["error"]) < 0.01


def test_predict_with_model_mismatch_and_jitter(tmp_path):
    # the "real" replicas follow a measured-looking table, not the fitted family, and
    # the trainer spans jitter by +-5%: the prediction must still be within 15%
    table = TableSpeed((1.0, 8.0, 24.0, 48.0), (55.0, 48.0, 36.0, 24.0))
    make_fake_run(tmp_path / "a", truth_config(speed=table), "async", groups=96, seed=1,
                  train_jitter=0.05)
    make_fake_run(tmp_path / "b", truth_config(speed=table, staleness_threshold=1.0,
                                               trigger_parameter_sync_step=2), "async",
                  groups=96, seed=2, train_jitter=0.05)
    out = predict(calibrate(tmp_path / "a"), tmp_path / "b")
    assert abs(out["error"]) < 0.15
    assert out["error"] != 0.0


def test_pdsr_runs_calibrate_without_moved_responses(tmp_path):
    truth = truth_config(speed=TRUE_SPEED, replicas=3, kv_budget_tokens=60000,
                         pdsr=PDSRConfig(offload_ratio=0.25, cap_factor=1.25, fast_max_num_seqs=96))
    summary = make_fake_run(tmp_path / "a", truth, "pdsr", groups=96, seed=3)
    assert summary["moved_responses"] > 0
    make_fake_run(tmp_path / "b", truth, "pdsr", groups=96, seed=4)
    assert run_settings(tmp_path / "b")["dispatch"] == "pdsr"
    cal = calibrate(tmp_path / "a")
    assert cal.c0 == pytest.approx(0.02, rel=0.1)
    out = predict(cal, tmp_path / "b")
    assert abs(out["error"]) < 0.05
    assert out["summary"]["dispatch"] == "pdsr"


def test_predict_needs_the_pipeline_settings(run_a, tmp_path):
    make_fake_run(tmp_path, truth_config(speed=TRUE_SPEED), "async", groups=48, seed=9)
    (tmp_path / "config.yaml").unlink()
    cal = calibrate(run_a)
    with pytest.raises(ValueError, match="staleness_threshold"):
        predict(cal, tmp_path)
    # ppo_mini_batch_size comes from the train spans' info.groups
    out = predict(cal, tmp_path, {"staleness_threshold": 0.5, "trigger_parameter_sync_step": 1,
                                  "partial_rollout": True})
    assert abs(out["error"]) < 0.01


def _write(path, lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


GOOD = {"uid": "e0-i0", "prompt_len": 5, "submit_time": 0.0, "finish_time": 2.0,
        "responses": [{"len": 3, "finish_reason": "stop", "replica": 0, "start": 0.0, "end": 2.0}]}


@pytest.mark.parametrize("line,match", [
    ("{not json", r"lengths.jsonl:1: not JSON"),
    ({k: v for k, v in GOOD.items() if k != "prompt_len"}, r":1: missing key 'prompt_len'"),
    ({**GOOD, "submit_time": "0"}, r"key 'submit_time' must be float"),
    ({**GOOD, "responses": []}, "has no responses"),
    ({**GOOD, "responses": [{**GOOD["responses"][0], "replica": True}]}, r"responses\[0\]: key 'replica'"),
    ({**GOOD, "responses": [{**GOOD["responses"][0], "end": -1.0}]}, "end >= start"),
])
def test_length_log_errors_name_file_line_and_key(tmp_path, line, match):
    _write(tmp_path / "rollout" / "lengths.jsonl", [line])
    with pytest.raises(RunLogError, match=match):
        read_lengths(tmp_path)


def test_logs_defaults_and_missing_files(tmp_path):
    _write(tmp_path / "rollout" / "lengths.jsonl", [GOOD])
    g = read_lengths(tmp_path)[0]
    assert g["responses"][0]["probe"] is False and g["responses"][0]["regenerated_tokens"] == 0
    assert read_lengths(tmp_path / "rollout" / "lengths.jsonl")[0]["uid"] == "e0-i0"
    with pytest.raises(RunLogError, match="timeline.jsonl: file not found"):
        read_timeline(tmp_path)
    _write(tmp_path / "timeline.jsonl", [{"lane": "sync", "kind": "sync", "start": 2.0, "end": 1.0}])
    with pytest.raises(RunLogError, match=r"timeline.jsonl:1: span ends before it starts"):
        read_timeline(tmp_path)
    _write(tmp_path / "timeline.jsonl", [{"lane": "sync", "kind": "sync", "start": 1.0, "end": 2.0}])
    with pytest.raises(RunLogError, match="no 'train' spans"):
        calibrate(tmp_path)
