"""The Rollouter's logs as JSON lines: `rollout/lengths.jsonl` (one line per queued group; the
simulator and scripts/bench_pdsr.py replay it, docs/log_formats.md) and `rollout/failed_prompts.jsonl`."""

from __future__ import annotations

import json
from typing import Any

from verl_async.protocol import RolloutSample


def lengths_record(sample: RolloutSample, submit: float, finish: float) -> dict[str, Any]:
    """One lengths.jsonl line: the group's versions and times, and per response its length and schedule."""
    return {
        "uid": sample.uid,
        "index": sample.index,
        "epoch": sample.epoch,
        "prompt_len": len(sample.prompt_ids),
        "param_version_start": sample.param_version_start,
        "param_version_end": sample.param_version_end,
        "submit_time": round(submit, 6),
        "finish_time": round(finish, 6),
        "responses": [
            {
                "len": len(r),
                "finish_reason": r.finish_reason,
                "replica": r.replica,
                "start": round(r.start_time, 6),
                "end": round(r.end_time, 6),
                "min_version": r.min_version,
                "max_version": r.max_version,
                "probe": bool(r.sched.get("probe", False)),
                "moved": bool(r.sched.get("moved", False)),
                "regenerated_tokens": int(r.sched.get("regenerated_tokens", 0)),
            }
            for r in sample.responses
        ],
    }


def append_jsonl(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
