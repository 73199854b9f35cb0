"""The whole pipeline with async_training.long_tail.enable=true (2 CPU replicas, tiny model)."""

from __future__ import annotations

import json
import os

import pytest

from tests.test_pipeline_integration import data_files, overrides, trained_log  # noqa: F401 (fixture)
from verl_async.config import compose, validate
from verl_async.pipeline import run

pytestmark = pytest.mark.slow


def test_pdsr_pipeline_trains_every_prompt_once_with_probe_groups(ray_session, tmp_path, tiny_model_dir, data_files):
    cfg = validate(compose(overrides=overrides(
        tmp_path, tiny_model_dir, data_files,
        "rollout.n_gpus_per_node=2", "async_training.long_tail.enable=true",
        "async_training.long_tail.batch_size=3", "async_training.long_tail.fast_max_num_seqs=12",
        "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=2",
        "async_training.partial_rollout=true",
    )))
    run(cfg)
    uids = [u for entry in trained_log(tmp_path) for u in entry["uids"]]
    assert len(uids) == 8 and len(set(uids)) == 8

    [lengths] = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == "lengths.jsonl"]
    groups = [json.loads(line) for line in open(lengths)]
    assert sorted(g["uid"] for g in groups) == sorted(uids)
    for g in groups:
        assert [r["probe"] for r in g["responses"]] == [True, False]  # n = 2: probe + one rest, one group
        assert all(r["regenerated_tokens"] == 0 for r in g["responses"])

    from verl_async.utils.tb_read import read_scalars

    tags = set(read_scalars(str(tmp_path / "run")))
    for tag in ["pdsr/offload_count", "pdsr/breaker_rate", "pdsr/breaker_prompt_rate", "pdsr/regenerated_tokens",
                "rollout/replica0/busy_ratio", "rollout/replica1/busy_ratio", "rollout/group_latency_p95"]:
        assert tag in tags, tag
