"""Where a run's start-up goes: phases recorded by every process, drawn in the timeline, summed at the end.

Each actor keeps a `StartupClock` (absolute `time.time()` phases) and answers `startup_report()`; whoever
created the actor knows when it asked for it and writes the actor's lane into the run's timeline
(`record_actor`): `worker` (Ray placing the actor and starting its process: the creation call to the first
import of verl_async in it), `imports` (that import to the class's `__init__`: the module tree of the actor's
class, torch and transformers included) and then the actor's own phases. Spans have kind `startup`, lane
`startup/<who>` and `info.phase`; the driver's phases before the run started (the entry point's checks)
have negative times. `startup_breakdown` turns the spans into `startup/<who>/<phase>` seconds plus the
milestones, `format_startup` into the end-of-run lines. Phase names: docs/log_formats.md.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

Phase = tuple[str, float, float]  # (name, start, end) in time.time() seconds

KIND = "startup"
LANE_ORDER = ("driver", "rollouter", "replica", "trainer", "rank")  # the summary's order (prefixes)


def process_started_at() -> Optional[float]:
    """This process's start as a time.time() value (Linux /proc, 10 ms resolution); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        ticks = int(after_name[19])  # field 22 of proc(5), starttime: clock ticks after boot
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def package_imported_at() -> Optional[float]:
    """When this process first imported verl_async (the package's first line runs then)."""
    import verl_async

    return getattr(verl_async, "IMPORTED_AT", None)


class StartupClock:
    """One actor's phases: created at the top of its `__init__`, `phase(name)` around each step of its start."""

    def __init__(self) -> None:
        self.init_at = time.time()
        self.phases: list[Phase] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.phases.append((name, start, time.time()))

    def add(self, phases: Iterable[Phase]) -> None:
        self.phases.extend((str(n), float(a), float(b)) for n, a, b in phases)

    def report(self) -> dict[str, Any]:
        return {"imported_at": package_imported_at(), "init_at": self.init_at, "phases": list(self.phases)}


def actor_phases(created_at: float, report: Mapping[str, Any]) -> list[Phase]:
    """The actor's phases with `worker` and `imports` in front, from the time its creator asked for it.

    A process that imported verl_async before the actor was asked for (a worker Ray reused) spent no time on
    the package here: `worker` ends at the creation call and `imports` holds what the class still loaded.
    """
    init_at = float(report["init_at"])
    imported = report.get("imported_at")
    split = created_at if imported is None or imported < created_at else min(float(imported), init_at)
    return [("worker", created_at, max(created_at, split)), ("imports", split, max(split, init_at)),
            *[(str(n), float(a), float(b)) for n, a, b in report.get("phases", [])]]


def record_phases(timeline: Any, lane: str, phases: Iterable[Phase], **info: Any) -> None:
    """Write phases (absolute times) into the run's timeline as `startup` spans on `startup/<lane>`."""
    for name, start, end in phases:
        timeline.record(f"startup/{lane}", KIND, start - timeline.run_start, end - timeline.run_start,
                        phase=name, **info)


def record_actor(timeline: Any, lane: str, created_at: float, report: Mapping[str, Any]) -> None:
    record_phases(timeline, lane, actor_phases(created_at, report))


def lane_sort_key(lane: str) -> tuple[int, int, str]:
    """Processes in the order a run starts them (driver, Rollouter, replicas, Trainer, ranks), numbers numerically."""
    for i, prefix in enumerate(LANE_ORDER):
        if lane.startswith(prefix):
            tail = lane[len(prefix):]
            return i, int(tail) if tail.isdigit() else -1, lane
    return len(LANE_ORDER), 0, lane


def startup_breakdown(spans: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """`startup/<who>/<phase>` seconds (a phase recorded twice adds up) and the milestones, seconds since the run
    started: `startup/first_sync_s` (the first weight sync's end), `startup/first_token_s` (the first generation
    began), `startup/first_step_s` (the first training step ended), `startup/before_run_s` (the entry point's
    part before the run started: interpreter, Hydra, checks, imports) and `startup/command_s` (the command to the
    first token). Start-up spans that begin after the first token (a trainer restarted by healing) are left out."""
    gen = [float(s["start"]) for s in spans if s["kind"] == "generate"]
    horizon = min(gen) if gen else float("inf")
    out: dict[str, float] = {}
    earliest = 0.0
    for s in spans:
        if s["kind"] != KIND or float(s["start"]) > horizon:
            continue
        who = s["lane"].split("/", 1)[1] if s["lane"].startswith("startup/") else s["lane"]
        key = f"startup/{who}/{s['info'].get('phase', '?')}"
        out[key] = out.get(key, 0.0) + max(0.0, float(s["end"]) - float(s["start"]))
        earliest = min(earliest, float(s["start"]))
    syncs = [float(s["end"]) for s in spans if s["kind"] == "sync"]
    train = [float(s["end"]) for s in spans if s["kind"] == "train" and s["lane"].startswith("trainer")]
    if syncs:
        out["startup/first_sync_s"] = min(syncs)
    if gen:
        out["startup/first_token_s"] = min(gen)
    if train:
        out["startup/first_step_s"] = min(train)
    if earliest < 0:
        out["startup/before_run_s"] = -earliest
        if gen:
            out["startup/command_s"] = min(gen) - earliest
    return out


MILESTONES = ("first_sync_s", "first_token_s", "first_step_s", "before_run_s", "command_s")


def format_startup(breakdown: Mapping[str, float]) -> list[str]:
    """The end-of-run lines: the milestones, then one line per process with its phases in seconds."""
    if "startup/first_token_s" not in breakdown:
        return []
    head = f"start-up: first generated token at {breakdown['startup/first_token_s']:.1f} s after the run started"
    if "startup/command_s" in breakdown:
        head += f" ({breakdown['startup/command_s']:.1f} s after the command)"
    if "startup/first_sync_s" in breakdown:
        head += f", first weight sync done at {breakdown['startup/first_sync_s']:.1f} s"
    if "startup/first_step_s" in breakdown:
        head += f", first step trained at {breakdown['startup/first_step_s']:.1f} s"
    lanes: dict[str, list[tuple[str, float]]] = {}
    for key, value in breakdown.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[2] not in MILESTONES:
            lanes.setdefault(parts[1], []).append((parts[2], value))
    lines = [head]
    width = max((len(lane) for lane in lanes), default=0)
    for lane in sorted(lanes, key=lane_sort_key):
        lines.append(f"  {lane:<{width}}  " + ", ".join(f"{name} {value:.1f}" for name, value in lanes[lane]))
    return lines
