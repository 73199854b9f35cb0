"""Spans of generation, training, waiting and sync, so a bubble is seen, not computed.

Every actor appends spans to `<run_dir>/timeline.jsonl` (one JSON line each, written
with a single O_APPEND write so lines from several processes never interleave);
`render_timeline_html` draws them as a self-contained HTML page (inline SVG, no
network), one lane per replica / worker.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import time
from typing import Any, Iterable, Iterator, Optional

from verl_async.utils.startup import startup_breakdown

KIND_COLORS = {
    "generate": "#4c9be8",
    "train": "#e8964c",
    "logprob": "#d4b84a",
    "wait": "#c8c8c8",
    "sync": "#d0453a",
    "validate": "#7cc16f",
    "val_wait": "#b5dcae",
    "pause": "#9a7fc9",
    "hold_budget": "#f2c9c9",  # the Rollouter may start no group: staleness budget spent until the next sync
    "hold_sync": "#e7a3a3",  # ... a weight sync is under way
    "hold_inflight": "#f0e0b0",  # ... rollout.max_inflight_groups reached
    "startup": "#8fb3a8",  # a start-up phase (utils/startup.py: info.phase names it; before the run: negative times)
}


class Timeline:
    """Appends spans; times are seconds since `run_start` (a time.time() value shared by the run)."""

    def __init__(self, path: Optional[str], run_start: float) -> None:
        self.path = path
        self.run_start = run_start
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def now(self) -> float:
        return time.time() - self.run_start

    def record(self, lane: str, kind: str, start: float, end: float, version: int = -1, **info: Any) -> None:
        if not self.path:
            return
        line = json.dumps(
            {"lane": lane, "kind": kind, "start": round(start, 6), "end": round(end, 6), "version": version, "info": info}
        )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def span(self, lane: str, kind: str, version: int = -1, **info: Any) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.record(lane, kind, start, self.now(), version, **info)


def read_spans(path: str, offset: int = 0) -> list[dict]:
    """The spans of `path`; `offset`: from that byte on (the file's size when a run started: that run's spans)."""
    spans = []
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            line = line.strip()
            if line:
                spans.append(json.loads(line))
    return spans


def busy_fraction(spans: list[dict], lane_prefix: str, kinds: tuple[str, ...], wall: Optional[float] = None) -> float:
    """Fraction of wall time lanes starting with `lane_prefix` spend in `kinds` (mean over lanes)."""
    lanes: dict[str, float] = {}
    for s in spans:
        if s["lane"].startswith(lane_prefix):
            lanes.setdefault(s["lane"], 0.0)
            if s["kind"] in kinds:
                lanes[s["lane"]] += s["end"] - s["start"]
    if not lanes:
        return 0.0
    total = wall if wall is not None else max((s["end"] for s in spans), default=0.0)
    if total <= 0:
        return 0.0
    return sum(min(v, total) for v in lanes.values()) / (len(lanes) * total)


def render_timeline_html(spans: list[dict], out_path: str, title: str = "verl_async timeline") -> str:
    """Write a self-contained HTML timeline (one row per lane); returns the path."""
    lanes = sorted({s["lane"] for s in spans}, key=lambda x: (x.startswith("startup"), not x.startswith("rollout"), x))
    t0 = min(0.0, min((s["start"] for s in spans), default=0.0))  # the entry point's start-up phases come before 0
    t_end = max((s["end"] for s in spans), default=1.0) or 1.0
    width, row_h, left = 1400, 26, 170
    scale = (width - left - 10) / max(t_end - t0, 1e-9)
    height = row_h * (len(lanes) + 2) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" font-size="11">'
    ]
    for i, lane in enumerate(lanes):
        y = 10 + i * row_h
        parts.append(f'<text x="4" y="{y + 15}">{html.escape(lane)}</text>')
        parts.append(f'<line x1="{left}" y1="{y + row_h - 2}" x2="{width - 10}" y2="{y + row_h - 2}" stroke="#eee"/>')
    index = {lane: i for i, lane in enumerate(lanes)}
    for s in spans:
        y = 10 + index[s["lane"]] * row_h
        x = left + (s["start"] - t0) * scale
        w = max(0.5, (s["end"] - s["start"]) * scale)
        color = KIND_COLORS.get(s["kind"], "#888")
        kind = s.get("info", {}).get("phase", s["kind"]) if s["kind"] == "startup" else s["kind"]
        tip = html.escape(f'{kind} v{s.get("version", -1)} {s["start"]:.2f}-{s["end"]:.2f}s {s.get("info", {})}')
        parts.append(
            f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row_h - 6}" fill="{color}"><title>{tip}</title></rect>'
        )
    y_axis = 10 + len(lanes) * row_h + 14
    for k in range(11):
        t = t0 + (t_end - t0) * k / 10
        x = left + (t - t0) * scale
        parts.append(f'<text x="{x:.1f}" y="{y_axis}" text-anchor="middle">{t:.1f}s</text>')
    legend_y = y_axis + 18
    for j, (kind, color) in enumerate(KIND_COLORS.items()):
        parts.append(f'<rect x="{left + j * 100}" y="{legend_y - 10}" width="12" height="12" fill="{color}"/>')
        parts.append(f'<text x="{left + j * 100 + 16}" y="{legend_y}">{kind}</text>')
    parts.append("</svg>")
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body><h3>{html.escape(title)}</h3>{''.join(parts)}</body></html>"
    )
    with open(out_path, "w") as f:
        f.write(page)
    return out_path


def union_length(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of intervals, clipped to [lo, hi]."""
    total, end = 0.0, lo
    for s, e in sorted((max(lo, s), min(hi, e)) for s, e in intervals):
        if e <= s:
            continue
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def timeline_metrics(run_dir: str) -> dict[str, float]:
    """Wall time, busy/idle ratios and trained tokens/s of one run, from the first generated token
    to the end of the last training step (start-up and final validation excluded)."""
    spans = read_spans(os.path.join(run_dir, "timeline.jsonl"))
    gen = [(s["start"], s["end"]) for s in spans if s["kind"] == "generate"]
    train = [(s["start"], s["end"]) for s in spans if s["lane"].startswith("trainer") and s["kind"] in ("train", "logprob")]
    wait = [(s["start"], s["end"]) for s in spans if s["lane"].startswith("trainer") and s["kind"] == "wait"]
    sync = [(s["start"], s["end"]) for s in spans if s["kind"] == "sync"]
    if not gen or not train:
        raise RuntimeError(f"{run_dir}: no generate/train spans in timeline.jsonl")
    lo = min(s for s, _ in gen)
    hi = max(e for _, e in train)
    wall = hi - lo
    gen_busy, train_busy = union_length(gen, lo, hi), union_length(train, lo, hi)
    tokens = sum(s["info"].get("tokens", 0) for s in spans if s["kind"] == "train" and s["lane"].startswith("trainer"))
    holds = {reason: union_length([(s["start"], s["end"]) for s in spans if s["kind"] == f"hold_{reason}"], lo, hi)
             for reason in ("budget", "sync", "inflight")}
    return {
        "wall_s": wall,
        "gen_busy_s": gen_busy,
        "train_busy_s": train_busy,
        "sync_s": union_length(sync, lo, hi),
        "trainer_wait_s": union_length(wait, lo, hi),
        "trained_tokens": float(tokens),
        "trained_tokens_per_s": tokens / wall,
        "rollout_idle_ratio": 1.0 - gen_busy / wall,
        "trainer_idle_ratio": 1.0 - train_busy / wall,
        "pipeline_efficiency": max(gen_busy, train_busy) / wall,
        "generated_tokens": float(sum(s["info"].get("tokens", 0) for s in spans if s["kind"] == "generate")),
        # requests on the engines, averaged over the window (an engine that is busy but underfed shows here)
        "mean_running_requests": sum(min(e, hi) - max(s, lo) for s, e in gen if e > lo and s < hi) / wall,
        # the Rollouter could start no new group because ... (seconds in the window)
        "admission_hold_budget_s": holds["budget"],
        "admission_hold_sync_s": holds["sync"],
        "admission_hold_inflight_s": holds["inflight"],
        "startup_s": lo,  # run start (the driver's clock) to the first generated token
        **startup_breakdown(spans),  # where it went: startup/<who>/<phase> (utils/startup.py)
    }
