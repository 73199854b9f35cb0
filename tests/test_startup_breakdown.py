"""The start-up breakdown (verl_async/utils/startup.py): phases per process, the milestones, the end-of-run lines.

Pure code against hand-computed values; the end to end check (every lane of a real run in its timeline and its
summary) is in tests/test_new_user.py's second run.
"""

from __future__ import annotations

import os
import time

import pytest

from verl_async.utils.startup import (StartupClock, actor_phases, format_startup, process_started_at, record_actor,
                                      startup_breakdown)
from verl_async.utils.timeline import Timeline, read_spans, render_timeline_html, timeline_metrics


def span(lane, kind, start, end, **info):
    return {"lane": lane, "kind": kind, "start": start, "end": end, "version": -1, "info": info}


def test_an_actor_whose_process_imported_the_package_after_it_was_asked_for():
    report = {"imported_at": 12.0, "init_at": 15.5, "phases": [("model_load", 15.5, 17.0)]}
    assert actor_phases(10.0, report) == [("worker", 10.0, 12.0), ("imports", 12.0, 15.5), ("model_load", 15.5, 17.0)]


def test_a_reused_worker_spent_nothing_on_the_package_and_an_unknown_import_counts_as_imports():
    reused = {"imported_at": 3.0, "init_at": 11.0, "phases": []}  # a worker that imported verl_async before
    assert actor_phases(10.0, reused) == [("worker", 10.0, 10.0), ("imports", 10.0, 11.0)]
    unknown = {"imported_at": None, "init_at": 11.0, "phases": []}
    assert actor_phases(10.0, unknown) == [("worker", 10.0, 10.0), ("imports", 10.0, 11.0)]


def test_breakdown_sums_phases_per_process_and_names_the_milestones():
    spans = [
        span("startup/driver", "startup", -3.0, -1.0, phase="checks"),
        span("startup/driver", "startup", 0.0, 2.0, phase="ray_init"),
        span("startup/rank0", "startup", 3.0, 4.5, phase="model_load"),
        span("startup/rank0", "startup", 4.5, 5.0, phase="ref_model_load"),
        span("startup/driver", "startup", 6.0, 6.25, phase="first_sync"),
        span("sync", "sync", 6.0, 6.25),
        span("rollout/replica0", "generate", 7.0, 9.0, tokens=3),
        span("rollout/replica0", "generate", 7.5, 8.0, tokens=1),
        span("trainer/driver", "train", 9.0, 10.5, tokens=4),
        span("sync", "sync", 11.0, 11.1),
        # a trainer restarted by healing long after: its start-up is no part of the run's
        span("startup/rank0", "startup", 50.0, 52.0, phase="model_load"),
    ]
    assert startup_breakdown(spans) == {
        "startup/driver/checks": 2.0, "startup/driver/ray_init": 2.0, "startup/rank0/model_load": 1.5,
        "startup/rank0/ref_model_load": 0.5, "startup/driver/first_sync": 0.25,
        "startup/first_sync_s": 6.25, "startup/first_token_s": 7.0, "startup/first_step_s": 10.5,
        "startup/before_run_s": 3.0, "startup/command_s": 10.0,
    }
    assert startup_breakdown([span("startup/driver", "startup", 0.0, 1.0, phase="ray_init")]) == \
        {"startup/driver/ray_init": 1.0}  # a run that never generated: the phases it reached, no milestones


def test_the_end_of_run_lines_order_the_processes_as_the_run_starts_them():
    breakdown = {"startup/rank1/model_load": 1.0, "startup/rank0/model_load": 1.25, "startup/trainer/reserve": 0.0,
                 "startup/replica0/model_load": 2.0, "startup/driver/ray_init": 3.0, "startup/rollouter/data": 0.5,
                 "startup/replica10/model_load": 2.0, "startup/replica2/model_load": 2.0,
                 "startup/first_token_s": 9.04, "startup/first_step_s": 12.0, "startup/command_s": 11.5,
                 "startup/first_sync_s": 8.5, "startup/before_run_s": 2.46}
    assert format_startup(breakdown) == [
        "start-up: first generated token at 9.0 s after the run started (11.5 s after the command), first weight "
        "sync done at 8.5 s, first step trained at 12.0 s",
        "  driver     ray_init 3.0",
        "  rollouter  data 0.5",
        "  replica0   model_load 2.0",
        "  replica2   model_load 2.0",
        "  replica10  model_load 2.0",
        "  trainer    reserve 0.0",
        "  rank0      model_load 1.2",
        "  rank1      model_load 1.0",
    ]
    assert format_startup({"startup/driver/ray_init": 3.0}) == []


def test_clock_and_record_write_absolute_phases_relative_to_the_run(tmp_path):
    path = str(tmp_path / "timeline.jsonl")
    timeline = Timeline(path, run_start=1000.0)
    record_actor(timeline, "replica0", 1001.0, {"imported_at": 1002.0, "init_at": 1003.0,
                                                "phases": [("model_load", 1003.0, 1004.5)]})
    assert [(s["lane"], s["info"]["phase"], s["start"], s["end"]) for s in read_spans(path)] == [
        ("startup/replica0", "worker", 1.0, 2.0), ("startup/replica0", "imports", 2.0, 3.0),
        ("startup/replica0", "model_load", 3.0, 4.5)]
    clock = StartupClock()
    with clock.phase("data"):
        pass
    with pytest.raises(ValueError):
        with clock.phase("reward"):  # a phase that fails is recorded as far as it came
            raise ValueError("bad reward function")
    report = clock.report()
    assert [p[0] for p in report["phases"]] == ["data", "reward"]
    assert report["init_at"] <= report["phases"][0][1] <= report["phases"][1][2] <= time.time()
    assert report["imported_at"] is not None and report["imported_at"] <= report["init_at"]


def test_read_spans_from_an_offset_gives_one_runs_spans(tmp_path):
    path = str(tmp_path / "timeline.jsonl")
    Timeline(path, 0.0).record("sync", "sync", 1.0, 2.0)
    offset = os.path.getsize(path)  # a resumed run appends to the same file
    Timeline(path, 0.0).record("sync", "sync", 3.0, 4.0)
    assert [s["start"] for s in read_spans(path)] == [1.0, 3.0]
    assert [s["start"] for s in read_spans(path, offset=offset)] == [3.0]


def test_timeline_metrics_carry_the_breakdown_and_the_picture_starts_before_zero(tmp_path):
    spans = [span("startup/driver", "startup", -2.0, 0.0, phase="checks"),
             span("rollout/replica0", "generate", 5.0, 6.0, tokens=2),
             span("trainer/driver", "train", 6.0, 7.0, tokens=2)]
    timeline = Timeline(str(tmp_path / "timeline.jsonl"), 0.0)
    for s in spans:
        timeline.record(s["lane"], s["kind"], s["start"], s["end"], **s["info"])
    metrics = timeline_metrics(str(tmp_path))
    assert metrics["startup_s"] == 5.0 and metrics["startup/command_s"] == 7.0
    assert metrics["startup/driver/checks"] == 2.0
    page = open(render_timeline_html(read_spans(str(tmp_path / "timeline.jsonl")), str(tmp_path / "t.html"))).read()
    assert 'x="170.00"' in page  # the earliest span (-2 s) starts at the left edge, not left of it
    assert ">checks v-1 -2.00-0.00s" in page and ">-2.0s<" in page


def test_this_process_started_before_now():
    started = process_started_at()
    if started is None:
        pytest.skip("no /proc here")
    assert time.time() - 7 * 24 * 3600 < started <= time.time()


def test_the_report_reads_run_folders_and_the_device_archives(tmp_path, capsys):
    import subprocess
    import sys
    import tarfile

    for name, ray_s in (("a", 2.0), ("b", 1.5)):
        timeline = Timeline(str(tmp_path / "runs" / name / "timeline.jsonl"), 0.0)
        timeline.record("startup/driver", "startup", 0.0, ray_s, phase="ray_init")
        timeline.record("startup/driver", "startup", -1.0, 0.0, phase="checks")
        timeline.record("rollout/replica0", "generate", 4.0, 5.0, tokens=1)
    with tarfile.open(tmp_path / "runs.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "runs" / "a" / "timeline.jsonl", arcname="a/timeline.jsonl")
        tar.add(tmp_path / "runs" / "b" / "timeline.jsonl", arcname="b/timeline.jsonl")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "startup_report.py")
    out = subprocess.run([sys.executable, script, str(tmp_path / "runs.tar.gz"), str(tmp_path / "runs" / "a")],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["| seconds | a | b | a |", "|---|---|---|---|", "| **first_token_s** | 4.00 | 4.00 | 4.00 |",
                   "| **before_run_s** | 1.00 | 1.00 | 1.00 |", "| **command_s** | 5.00 | 5.00 | 5.00 |",
                   "| driver/checks | 1.00 | 1.00 | 1.00 |", "| driver/ray_init | 2.00 | 1.50 | 2.00 |"]
