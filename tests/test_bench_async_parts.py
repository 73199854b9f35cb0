"""The pure parts of the two-GPU benchmark (scripts/bench_async.py, scripts/plot_occupancy.py) and the
admission-hold metrics of utils/timeline.timeline_metrics, against hand-computed values."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_async  # noqa: E402
import plot_occupancy  # noqa: E402

from verl_async.utils.timeline import Timeline, timeline_metrics  # noqa: E402


@pytest.mark.parametrize("name, want", [
    ("sync", {"layout": "colocated", "staleness": 0.0, "partial": False, "trigger": 1}),
    ("s0.5_p1", {"layout": "split", "staleness": 0.5, "partial": True, "trigger": 3}),
    ("s2_p0_t4", {"layout": "split", "staleness": 2.0, "partial": False, "trigger": 4}),
    ("c1_p1_t2", {"layout": "colocated", "staleness": 1.0, "partial": True, "trigger": 2}),
])
def test_config_names(name, want):
    assert bench_async.parse_config(name, default_trigger=3) == want


@pytest.mark.parametrize("bad", ["s0.5", "x1_p1", "s1_p2", "s1_p1_t", "c_p1"])
def test_bad_config_names_are_refused(bad):
    with pytest.raises(ValueError, match="sync, sS_pP"):
        bench_async.parse_config(bad, 1)


@pytest.mark.parametrize("argv, config, want", [
    ([], "sync", "auto"),  # colocated: cuda_ipc for native replicas on CUDA (config/derived.py), else object_store
    ([], "c1_p1_t2", "auto"),
    (["--colocated-transport", "object_store"], "sync", "object_store"),  # the 25.0 s figure's transport
    (["--colocated-transport", "cuda_ipc"], "c1_p1_t2", "cuda_ipc"),
    (["--colocated-transport", "object_store"], "s0.5_p1_t4", "nccl"),  # split: always the collective
])
def test_colocated_runs_take_the_chosen_transport(argv, config, want):
    args = bench_async.fill_defaults(bench_async.make_parser().parse_args(["--device", "cuda", "--gpus", "2"] + argv))
    out = bench_async.overrides_for(config, args, "/m", "/d.parquet", "/run")
    assert f"async_training.sync_transport={want}" in out
    colocated = config != "s0.5_p1_t4"
    assert f"rollout.colocate={str(colocated).lower()}" in out
    assert f"trainer.n_gpus_per_node={2 if colocated else 1}" in out


def test_qwen_shapes_are_the_hub_configs():
    assert bench_async.SHAPES["7b"]["hidden_size"] == 3584 and not bench_async.SHAPES["7b"]["tie_word_embeddings"]
    assert {k: bench_async.SHAPES["1.5b"][k] for k in ("num_hidden_layers", "intermediate_size")} == {
        "num_hidden_layers": 28, "intermediate_size": 8960}


def test_running_requests_is_a_step_function_of_open_intervals():
    times, counts = plot_occupancy.running_requests([(0, 2), (1, 3), (2, 4), (5, 5)])
    # at 2 one ends and one starts: the level stays 2; the empty interval (5, 5) counts for nothing
    assert (times, counts) == ([0, 1, 2, 3, 4], [1, 2, 2, 1, 0])


def test_timeline_metrics_split_the_rollouts_waits_by_reason(tmp_path):
    tl = Timeline(str(tmp_path / "timeline.jsonl"), run_start=0.0)
    tl.record("rollout/replica0", "generate", 10.0, 14.0, tokens=40)
    tl.record("rollout/replica0", "generate", 12.0, 16.0, tokens=40)
    tl.record("rollout/admission", "hold_budget", 14.0, 17.0)
    tl.record("rollout/admission", "hold_sync", 17.0, 17.5)
    tl.record("trainer/driver", "train", 15.0, 20.0, tokens=100)
    m = timeline_metrics(str(tmp_path))
    assert m["wall_s"] == 10.0 and m["startup_s"] == 10.0
    assert m["mean_running_requests"] == pytest.approx(8.0 / 10.0)
    assert (m["admission_hold_budget_s"], m["admission_hold_sync_s"], m["admission_hold_inflight_s"]) == (3.0, 0.5, 0.0)
