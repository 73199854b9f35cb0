"""The command line (policies, sweep, stats, trace, calibrate/predict) and workloads."""

import json

import numpy as np
import pytest
from fake_run import make_fake_run, truth_config

from verl_async.sim import GroupSpec, StepLatencySpeed, groups_from_log, length_stats, synthetic_groups
from verl_async.sim.cli import main
from verl_async.sim.runlog import read_lengths, read_timeline, write_jsonl

SMALL = ["--replicas", "3", "--n", "4", "--ppo-mini-batch-size", "8", "--steps", "6",
         "--speed", "latency:0.01,0.0002", "--max-num-seqs", "32", "--kv-budget-tokens", "40000",
         "--fast-max-num-seqs", "64", "--staleness-threshold", "0.5", "--train-a", "2",
         "--train-b", "2e-5", "--sync-time", "1", "--synthetic", "longtail"]


def test_cli_policies_sweep_json_and_trace(tmp_path, capsys):
    out = main(SMALL + ["--sweep", "--offload-ratios", "0.1,0.3", "--cap-factors", "1.5,2",
                        "--json", str(tmp_path / "o.json"), "--trace-dir", str(tmp_path / "tr"),
                        "--markdown"])
    rows = out["runs"]
    assert [r["policy"] for r in rows] == ["sync", "async", "pdsr"] + ["pdsr"] * 4
    assert [(r.get("offload_ratio"), r.get("cap_factor")) for r in rows[3:]] == [
        (0.1, 1.5), (0.1, 2.0), (0.3, 1.5), (0.3, 2.0)]
    assert rows[1]["saving_vs_async"] == 0.0
    assert all(r["steps"] == 6 for r in rows)
    assert rows[0]["stale_max"] == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if "policy" in line)
    assert "wall s" in header and "saving vs async" in header and "breaker" in header
    assert "|---" in printed
    saved = json.loads((tmp_path / "o.json").read_text())
    assert len(saved["runs"]) == 7
    run_dirs = sorted((tmp_path / "tr").iterdir())
    assert [d.name for d in run_dirs][:3] == ["00-sync", "01-async", "02-pdsr"]
    assert len(read_lengths(run_dirs[2])) >= 6 * 8
    assert any(s["kind"] == "sync" for s in read_timeline(run_dirs[2]))
    assert any(r["probe"] for g in read_lengths(run_dirs[2]) for r in g["responses"])


def test_cli_stats(capsys):
    out = main(SMALL + ["--stats", "--policy", "async"])
    assert set(out["stats"]) >= {"cv_mean", "cv_max", "probe_fn_rate", "topk_precision_mean",
                                 "breaker_rate"}
    assert [r["policy"] for r in out["runs"]] == ["async"]


def test_cli_calibrate_predict_and_replay(tmp_path, capsys):
    truth = truth_config(speed=StepLatencySpeed(0.02, 0.0004))
    make_fake_run(tmp_path / "a", truth, "async", groups=64, seed=0)
    make_fake_run(tmp_path / "b", truth, "async", groups=64, seed=1)
    out = main(["--calibrate", str(tmp_path / "a"), "--save-calibration", str(tmp_path / "c.json"),
                "--predict", str(tmp_path / "b")])
    assert abs(out["predictions"][0]["error"]) < 0.01
    assert "error" in capsys.readouterr().out
    again = main(["--calibration", str(tmp_path / "c.json"), "--predict", str(tmp_path / "b")])
    assert again["predictions"][0]["predicted_wall"] == out["predictions"][0]["predicted_wall"]
    # replay a run's log under its own config.yaml with the calibrated model
    replay = main(["--calibration", str(tmp_path / "c.json"), "--log", str(tmp_path / "b"),
                   "--policy", "async", "--steps", "8"])
    assert replay["runs"][0]["wall_time"] == pytest.approx(out["predictions"][0]["predicted_wall"])
    with pytest.raises(SystemExit):
        main(["--predict", str(tmp_path / "b")])


def test_synthetic_reference_preset_is_near_the_measured_statistics():
    groups = synthetic_groups(2048, 8, "reference", seed=0)
    s = length_stats(groups, batch_size=64)
    assert 0.25 < s["cv_mean"] < 0.33            # measured 0.29
    assert 0.9 < s["cv_max"] < 1.6               # measured 1.18
    assert 0.55 < s["probe_fn_rate"] < 0.72      # measured 0.63
    assert all(1 <= x <= 4096 for g in groups for x in g.lengths)


def test_length_stats_by_hand():
    # batch of 4, n = 3, probe = first; offload 0.25 -> heavy = prompt 1 (probe 900)
    groups = [GroupSpec("a", 1, (100, 100, 100)), GroupSpec("b", 1, (900, 800, 1000)),
              GroupSpec("c", 1, (400, 700, 300)), GroupSpec("d", 1, (200, 600, 100))]
    s = length_stats(groups, batch_size=4, offload_ratio=0.25, cap_factor=1.5, threshold=512)
    # L_cut = 400 -> cap 600: fast rests 100,100 | 700,300 | 600,100 -> one breaker (700) of 6
    assert s["breaker_rate"] == pytest.approx(1 / 6)
    assert s["breaker_prompt_rate"] == pytest.approx(1 / 3)
    # probe < 512: a, c, d; with a rest > 512: c (700), d (600) -> 2/3
    assert s["probe_fn_rate"] == pytest.approx(2 / 3)
    assert s["topk_precision_mean"] == 1.0
    assert s["cv_mean"] == pytest.approx(np.mean([np.std(g.lengths) / np.mean(g.lengths) for g in groups]))
    own = length_stats(groups, 4, 0.25, 1.5, 512, cap_mode="probe")
    # own-probe caps a 150, c 600, d 300: breakers c's 700 and d's 600 -> 2 of 6
    assert own["breaker_rate"] == pytest.approx(2 / 6)


def test_groups_from_log_order_and_probe(tmp_path):
    def resp(n, probe=False):
        return {"len": n, "finish_reason": "stop", "replica": 0, "start": 0.0, "end": 1.0, "probe": probe}
    write_jsonl(tmp_path / "rollout" / "lengths.jsonl", [
        {"uid": "late", "index": 0, "prompt_len": 3, "submit_time": 5.0, "finish_time": 6.0,
         "responses": [resp(7), resp(9, probe=True)]},
        {"uid": "early", "index": 1, "prompt_len": 4, "submit_time": 1.0, "finish_time": 9.0,
         "responses": [resp(2), resp(3)]},
    ])
    g = groups_from_log(tmp_path)
    assert [x.uid for x in g] == ["early", "late"]
    assert (g[1].probe, g[1].probe_len, g[1].rest) == (1, 9, (7,))
    assert (g[0].probe, g[0].prompt_len) == (0, 4)
    with pytest.raises(ValueError, match="probe index"):
        GroupSpec("x", 1, (1, 2), probe=2)
