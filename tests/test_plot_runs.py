"""scripts/plot_runs.py on the real H100 runs archived in bench/real_model (TensorBoard + timeline)."""

from __future__ import annotations

import os
import runpy
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "bench", "real_model")

pytest.importorskip("matplotlib")
pytest.importorskip("tensorboard")


@pytest.fixture(scope="module")
def plot_runs():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        return runpy.run_path(os.path.join(ROOT, "scripts", "plot_runs.py"), run_name="plot_runs")
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))


def test_table_and_pictures_from_archived_runs(plot_runs, tmp_path):
    archives = [os.path.join(RUNS, f"{name}.tar.gz") for name in ("sync-1", "async-1")]
    assert plot_runs["main"]([*archives, "--out-dir", str(tmp_path), "--prefix", "t"]) == 0
    for suffix in ("accuracy.png", "curves.png"):
        with open(tmp_path / f"t_{suffix}", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "t_table.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines() if line.startswith("| sync-1") or line.startswith("| async-1")}
    # sync-1: 32 steps, 4096 samples; held-out accuracy 0.087 -> 0.313 (the run's console said so too)
    assert rows["sync-1"][:2] == ["32", "4096"]
    assert rows["sync-1"][6:8] == ["0.087", "0.313"]
    assert rows["async-1"][6:8] == ["0.080", "0.377"]
    assert float(rows["sync-1"][9]) == 0.0 and 0.3 < float(rows["async-1"][9]) <= 0.5  # staleness mean
    assert "| async | 1 | 0.377" in table


def test_a_folder_without_scalars_is_refused(plot_runs, tmp_path):
    (tmp_path / "empty-1").mkdir()
    with pytest.raises(SystemExit, match="no TensorBoard scalars"):
        plot_runs["load_run"](str(tmp_path / "empty-1"), str(tmp_path))
