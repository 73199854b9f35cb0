"""scripts/time_split.py: a run's time by phase, from hand-made timelines of the two validation modes."""

from __future__ import annotations

import json
import os
import runpy
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ts():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        return runpy.run_path(os.path.join(ROOT, "scripts", "time_split.py"), run_name="time_split")
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))


def span(lane, kind, start, end, version=0):
    return {"lane": lane, "kind": kind, "start": start, "end": end, "version": version, "info": {}}


def test_interval_helpers(ts):
    assert ts["merge"]([(3, 4), (0, 2), (1, 3), (5, 5)]) == [(0, 4)]
    assert ts["intersect"]([(0, 4), (6, 9)], [(3, 7), (8, 20)]) == [(3, 4), (6, 7), (8, 9)]
    assert ts["length"]([(0, 2), (1, 3), (10, 11)]) == 4


BLOCKING = [  # val_before_train, then a validation inside the sync of version 2 (val_async=false)
    span("rollout/replica0", "generate", 0, 5),  # start-up, before the first sync: outside the window
    span("sync", "sync", 10, 11),
    span("rollout/validation", "validate", 11, 15),  # before the first step: it held the trainer
    span("rollout/replica0", "generate", 15, 30),
    span("trainer/driver", "wait", 15, 20),
    span("trainer/driver", "train", 20, 24),
    span("sync", "sync", 24, 34, 2),
    span("rollout/validation", "validate", 25, 33, 2),
    span("trainer/driver", "train", 34, 40),
]
BESIDE = [  # val_async=true: the validation of version 2 runs beside training, the next sync waits 1 s
    span("sync", "sync", 10, 11),
    span("rollout/replica0", "generate", 11, 30),
    span("trainer/driver", "wait", 11, 20),
    span("trainer/driver", "train", 20, 24),
    span("sync", "sync", 24, 25, 2),
    span("rollout/validation", "validate", 25, 33, 2),
    span("trainer/driver", "train", 25, 32),
    span("sync", "sync", 32, 34, 3),
    span("trainer/driver", "val_wait", 32, 33, 2),
    span("trainer/driver", "train", 34, 40),
]


def test_a_blocking_validation_is_counted_as_holding_the_trainer(ts):
    out = ts["time_split"](BLOCKING)
    assert out["window_s"] == 30
    assert out["generation"] == 15 and out["training"] == 10 and out["trainer_wait"] == 5
    assert out["validation"] == 12 and out["val_blocking"] == 12  # 4 before the first step + 8 inside the sync
    assert out["sync"] == 11 - 8 and out["val_blocking_frac"] == pytest.approx(0.4)
    # the training window is 20..40: the validation before the first step is outside it, the one in the sync inside
    assert out["training_window_s"] == 20 and out["val_blocking_training"] == 8
    assert out["val_blocking_training_frac"] == pytest.approx(0.4)


def test_a_validation_beside_training_holds_the_trainer_only_where_a_sync_waits_for_it(ts):
    out = ts["time_split"](BESIDE)
    assert out["validation"] == 8 and out["val_blocking"] == 1  # the val_wait inside the sync of version 3
    assert out["sync"] == 1 + 1 + 2 - 1 and out["training"] == 17
    assert out["training_window_s"] == 20 and out["val_blocking_training_frac"] == pytest.approx(0.05)


def test_validations_before_the_first_step_and_after_the_last_are_outside_the_training_window(ts):
    spans = [span("sync", "sync", 0, 1), span("rollout/validation", "validate", 1, 5),  # before the first step
             span("trainer/driver", "train", 5, 15), span("sync", "sync", 15, 16, 1),
             span("trainer/driver", "train", 16, 25), span("rollout/validation", "validate", 25, 30, 1)]
    out = ts["time_split"](spans)
    assert out["val_blocking"] == 4 and out["validation"] == 9  # the final one holds no training: not blocking
    assert out["training_window_s"] == 20 and out["val_blocking_training"] == 0


def test_markdown_from_folders_and_archives(ts, tmp_path, capsys):
    for name, spans in (("blocking", BLOCKING), ("beside", BESIDE)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    with tarfile.open(tmp_path / "beside-2.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "beside" / "timeline.jsonl", arcname="timeline.jsonl")
    assert ts["main"]([str(tmp_path / "blocking"), str(tmp_path / "beside-2.tar.gz")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| run | window s | generation")
    assert lines[2].startswith("| blocking | 30.0 | 15.0 (50%)") and "| 12.0 (40%) | 12.0 (40%) |" in lines[2]
    assert lines[2].endswith("| 20.0 | 8.0 (40.0%) |")
    assert lines[3].startswith("| beside-2 | 30.0 |")


def test_a_timeline_without_syncs_is_refused(ts):
    with pytest.raises(ValueError, match="no sync span"):
        ts["time_split"]([span("trainer/driver", "train", 0, 1)])
