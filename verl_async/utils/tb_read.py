"""Read a run's TensorBoard scalars back (tests, benchmarks, plots): the one place that knows the format."""

from __future__ import annotations

import os
from typing import NamedTuple


class Point(NamedTuple):
    step: int
    wall_time: float
    value: float


def read_scalars(run_dir: str) -> dict[str, list[Point]]:
    """{tag: points in step order} from `<run_dir>/tensorboard` (or `run_dir` itself when it holds the events)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = os.path.join(run_dir, "tensorboard")
    if not os.path.isdir(folder):
        folder = run_dir
    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [Point(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags().get("scalars", [])}
