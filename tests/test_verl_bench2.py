"""scripts/device/verl_bench2.py: the two-GPU verl comparison takes bench_async's workload and our run's settings
from bench_async itself (issue 37 item 3), so the two measure one workload."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "device"))
import verl_bench2  # noqa: E402


def test_the_workload_is_bench_asyncs_long_tail_on_two_gpus():
    a = verl_bench2.bench_args(8, "1.5b")
    assert (a.gpus, a.engine, a.shape, a.steps, a.prompts_per_step, a.n) == (2, "native", "1.5b", 8, 16, 8)
    assert (a.length_mean, a.max_response_length, a.cv_between, a.cv_within, a.max_prompt_length) == (512, 2048, 0.8, 0.4, 128)


@pytest.mark.parametrize("config, gpus, colocate, transport, staleness, trigger", [
    ("s0.5_p1_t4", "1", "false", "nccl", "0.5", "4"),
    ("sync", "2", "true", "auto", "0.0", "1"),
])
def test_our_runs_get_bench_asyncs_overrides(config, gpus, colocate, transport, staleness, trigger):
    args = verl_bench2.bench_args(8, "1.5b", config)
    got = dict(kv.split("=", 1) for kv in verl_bench2.ours_overrides(config, "/w", "/r/x", args))
    assert got["actor_rollout_ref.model.path"] == "/w/model" and got["data.train_files"] == "/w/train.parquet"
    assert got["trainer.default_local_dir"] == "/r/x" and got["rollout.total_rollout_steps"] == "128"
    assert (got["trainer.n_gpus_per_node"], got["rollout.n_gpus_per_node"], got["rollout.colocate"]) == (gpus, gpus, colocate)
    assert (got["async_training.sync_transport"], got["async_training.staleness_threshold"],
            got["async_training.trigger_parameter_sync_step"]) == (transport, staleness, trigger)
    assert got["actor_rollout_ref.rollout.name"] == "native" and got["actor_rollout_ref.rollout.ignore_eos"] == "true"


def test_a_config_bench_async_does_not_know_is_refused(capsys):
    with pytest.raises(SystemExit):
        verl_bench2.main(["ours", "s0.5_q1", "/w", "/r"])
    assert "unknown --configs ['s0.5_q1']" in capsys.readouterr().err
