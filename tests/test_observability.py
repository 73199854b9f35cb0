import glob

import pytest
import torch

from verl_async.utils.timeline import Timeline, busy_fraction, read_spans, render_timeline_html
from verl_async.utils.tracking import Tracker


def test_timeline_roundtrip_and_render(tmp_path):
    tl = Timeline(str(tmp_path / "timeline.jsonl"), run_start=0.0)
    tl.record("rollout/replica0", "generate", 0.0, 3.0, version=0, tokens=10)
    tl.record("rollout/replica0", "wait", 3.0, 4.0, version=0)
    tl.record("trainer/rank0", "wait", 0.0, 3.0, version=0)
    tl.record("trainer/rank0", "train", 3.0, 4.0, version=0)
    spans = read_spans(str(tmp_path / "timeline.jsonl"))
    assert len(spans) == 4 and spans[0]["info"] == {"tokens": 10}
    assert busy_fraction(spans, "rollout", ("generate",)) == pytest.approx(0.75)
    assert busy_fraction(spans, "trainer", ("train",)) == pytest.approx(0.25)
    out = render_timeline_html(spans, str(tmp_path / "t.html"))
    page = open(out).read()
    assert page.count("<rect") >= 4 and "rollout/replica0" in page and "trainer/rank0" in page


def test_timeline_disabled_writes_nothing(tmp_path):
    tl = Timeline(None, run_start=0.0)
    with tl.span("x", "train"):
        pass
    assert not list(tmp_path.iterdir())


def test_tracker_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tr = Tracker(["tensorboard"], str(tmp_path))
    tr.log({"reward/mean": 0.5, "skip": "text", "t": torch.tensor(2.0), "flag": True}, step=3)
    tr.close()
    acc = EventAccumulator(glob.glob(str(tmp_path / "events*"))[0])
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward/mean", "t", "flag"}
    assert acc.Scalars("reward/mean")[0].step == 3 and acc.Scalars("reward/mean")[0].value == 0.5


def test_tracker_unknown_logger():
    with pytest.raises(ValueError, match="trainer.logger"):
        Tracker(["clearml"], "/tmp/x")  # a verl logger verl_async does not support
