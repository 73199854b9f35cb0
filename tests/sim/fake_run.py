"""A small fake-run generator: a simulated run written as a run dir in the binding
log format (LOG_FORMATS.md) with a config.yaml of verl keys, plus optional jitter
on the trainer spans so a calibration is not an identity."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from verl_async.sim import SimConfig, policy_config, simulate, synthetic_groups
from verl_async.sim.calibrate import write_simulated_run
from verl_async.sim.runlog import TIMELINE_FILE


def make_fake_run(run_dir: Path, truth: SimConfig, policy: str = "async", groups: int = 96,
                  seed: int = 0, train_jitter: float = 0.0, preset: str = "reference") -> dict:
    cfg = policy_config(truth, policy)
    res = simulate(cfg, synthetic_groups(groups, cfg.n, preset, seed))
    write_simulated_run(run_dir, cfg, res)
    if train_jitter:
        rng = np.random.default_rng(seed + 1000)
        path = Path(run_dir) / TIMELINE_FILE
        spans = [json.loads(x) for x in path.read_text().splitlines()]
        for s in spans:
            if s["kind"] == "train":
                s["end"] = s["start"] + (s["end"] - s["start"]) * (1 + train_jitter * rng.uniform(-1, 1))
        path.write_text("".join(json.dumps(s) + "\n" for s in spans))
    return res.summary


def truth_config(**kw) -> SimConfig:
    base = SimConfig(n=4, ppo_mini_batch_size=8, max_response_length=4096, replicas=2,
                     max_num_seqs=48, train_a=3.0, train_b=4e-5, sync_time=1.5,
                     staleness_threshold=0.5, trigger_parameter_sync_step=1)
    return replace(base, **kw)
