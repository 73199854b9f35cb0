"""The device scripts' background queue (scripts/device/queue.sh), run here with a stand-in for a GPU run.

Why it matters: one device call ends after 10 minutes and a verl run takes 25, so runs are queued in the
background and each `wait:` call brings back what finished; a machine taken back mid-run must still leave
the run's first part with us (a cut 1,500 s verl run came back that way).
"""
from __future__ import annotations

import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
QUEUE_LIB = REPO_ROOT / "scripts" / "device" / "queue.sh"

# A device script in miniature: the same queue:/wait: phases, and a "run" that writes as it goes and archives at the end.
STAND_IN = f"""#!/usr/bin/env bash
set -uo pipefail
STORE=$BASE/store RUNS=$BASE/runs
mkdir -p "$OUT" "$STORE" "$RUNS"
source {QUEUE_LIB}
for phase in "$@"; do
  case "$phase" in
    run:*)
      spec=${{phase#run:}} name=${{spec%%:*}} seconds=${{spec#*:}}
      dir=$(run_dir "$name")
      echo "started $name" > "$dir/console.log"
      sleep "$seconds"
      echo "finished $name" >> "$dir/console.log"
      (cd "$dir" && tar czf "$STORE/$name.tar.gz" console.log) ;;
    queue:*) queue_start "$0" "${{phase#queue:}}" ;;
    wait:*)
      queue_wait "${{phase#wait:}}" 5
      send_finished "$STORE"/*.tar.gz
      send_partial console.log ;;
  esac
done
"""


def _call(script: Path, base: Path, out: Path, *phases: str, timeout: float = 60) -> str:
    """One device call: a fresh $OUT, as the device tool gives each call."""
    env = {**os.environ, "BASE": str(base), "OUT": str(out), "QUEUE_POLL_S": "0.1"}
    proc = subprocess.run(["bash", str(script), *phases], env=env, capture_output=True, text=True, timeout=timeout,
                          check=True)
    return proc.stdout


def _console(archive: Path) -> str:
    with tarfile.open(archive) as tar:
        member = tar.extractfile("console.log")
        assert member is not None
        return member.read().decode()


@pytest.fixture
def stand_in(tmp_path: Path):
    script = tmp_path / "device_script.sh"
    script.write_text(STAND_IN)
    yield script, tmp_path
    pids = tmp_path / "store" / "queue.pids"
    for pid in pids.read_text().split() if pids.exists() else []:  # a failed test leaves no queue behind
        try:
            os.killpg(int(pid), signal.SIGKILL)  # setsid: the queue leads its own process group
        except ProcessLookupError:
            pass


def test_a_wait_call_brings_back_finished_runs_once_and_a_snapshot_of_the_run_still_going(stand_in):
    script, base = stand_in
    t0 = time.monotonic()
    queued = _call(script, base, base / "out1", "queue:run:short:0.2,run:long:3")
    assert "queued: run:short:0.2,run:long:3" in queued
    assert time.monotonic() - t0 < 2.5, "queue: must return at once, not wait for the runs"

    # the queue outlived the call that started it: the short run finishes, the long one is under way
    deadline = time.monotonic() + 30
    while not (base / "runs" / "long" / "console.log").exists():
        assert time.monotonic() < deadline, "the long run never started"
        time.sleep(0.05)
    out2 = base / "out2"
    _call(script, base, out2, "wait:0")
    assert sorted(p.name for p in out2.iterdir()) == ["long-partial.tar.gz", "short.tar.gz"]
    assert _console(out2 / "short.tar.gz") == "started short\nfinished short\n"
    assert _console(out2 / "long-partial.tar.gz") == "started long\n"

    out3 = base / "out3"
    _call(script, base, out3, "wait:30")
    assert sorted(p.name for p in out3.iterdir()) == ["long.tar.gz"], "short was sent before; long has finished"
    assert _console(out3 / "long.tar.gz") == "started long\nfinished long\n"


def test_a_folder_not_made_by_run_dir_is_not_sent_as_a_partial_run(stand_in):
    script, base = stand_in
    foreign = base / "runs" / "foreign"
    foreign.mkdir(parents=True)
    (foreign / "console.log").write_text("not a queued run\n")
    out = base / "out"
    _call(script, base, out, "run:quick:0", "wait:0")
    assert sorted(p.name for p in out.iterdir()) == ["quick.tar.gz"]
