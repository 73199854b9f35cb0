"""Where a run's time went: generation, training, validation, sync and waiting, from its timeline.jsonl.

    python scripts/time_split.py RUN [RUN ...]        # RUN: a run folder or a .tar.gz of one

Prints one markdown table (seconds and share of the window per phase). The window runs from the
first sync (the first weight push, right before training starts) to the last span's end. Phases
overlap (generation runs beside training), so the shares do not add up to 100%; each is the
union of its spans:

  generation     any replica generating (`generate`)
  training       the trainer computing (`train`, `logprob`)
  validation     a validation generating and scoring (`validate`)
  val_blocking   the trainer held by a validation: a validation inside a sync or before the first
                 training step (trainer.val_async=false, val_before_train), or a sync waiting for
                 one still running (`val_wait`, val_async=true)
  sync           syncs without their val_blocking part
  trainer_wait   the trainer waiting for groups (`wait`)

Issue 27 reads "validation 81 s of 181 s, training waited" as val_blocking; with val_async the
validation runs beside training and val_blocking should fall towards the waits at syncs.

Two more columns measure issue 42's "validation holds the trainer <= 5% of the training window":
the training window runs from the first training step's start to the last one's end, and
`val_blocking_training` is the part of val_blocking inside it. A validation before the first step
(`val_before_train`, which blocks in verl too) delays the start; the final one runs after the last
step. Neither can stall a training that is under way, so both stay in val_blocking and out of this
column.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
from typing import Iterable, Sequence

Interval = tuple[float, float]
PHASES = ("generation", "training", "validation", "val_blocking", "sync", "trainer_wait")


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of intervals (empty ones dropped)."""
    out: list[Interval] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two unions (each merged first)."""
    a, b = merge(a), merge(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in merge(intervals))


def time_split(spans: Sequence[dict]) -> dict[str, float]:
    """Seconds per phase (module docstring) and `window_s`; `*_frac` is each phase's share of the window."""

    def pick(kinds: tuple[str, ...], lane: str = "") -> list[Interval]:
        return [(s["start"], s["end"]) for s in spans if s["kind"] in kinds and s["lane"].startswith(lane)]

    syncs = pick(("sync",))
    if not syncs:
        raise ValueError("timeline has no sync span: not a verl_async run's timeline.jsonl")
    lo, hi = min(s for s, _ in syncs), max(s["end"] for s in spans)
    clip = [(lo, hi)]
    train = intersect(pick(("train", "logprob"), "trainer"), clip)
    first_train = train[0][0] if train else hi
    validate = intersect(pick(("validate",)), clip)
    blocking = merge(intersect(validate, syncs + [(lo, first_train)]) + intersect(pick(("val_wait",)), clip))
    out = {
        "window_s": hi - lo,
        "generation": length(intersect(pick(("generate",)), clip)),
        "training": length(train),
        "validation": length(validate),
        "val_blocking": length(blocking),
        "sync": length(intersect(syncs, clip)) - length(intersect(blocking, syncs)),
        "trainer_wait": length(intersect(pick(("wait",), "trainer"), clip)),
    }
    for phase in PHASES:
        out[f"{phase}_frac"] = out[phase] / out["window_s"] if out["window_s"] > 0 else 0.0
    training_window = [(train[0][0], train[-1][1])] if train else []
    out["training_window_s"] = length(training_window)
    out["val_blocking_training"] = length(intersect(blocking, training_window))
    out["val_blocking_training_frac"] = (out["val_blocking_training"] / out["training_window_s"]
                                         if out["training_window_s"] > 0 else 0.0)
    return out


def read_timeline(run: str) -> list[dict]:
    """The spans of a run folder or of a .tar.gz holding its timeline.jsonl."""
    if run.endswith((".tar.gz", ".tgz")):
        with tarfile.open(run) as tar:
            member = next(m for m in tar.getmembers() if os.path.basename(m.name) == "timeline.jsonl")
            text = io.TextIOWrapper(tar.extractfile(member)).read()
    else:
        with open(os.path.join(run, "timeline.jsonl")) as f:
            text = f.read()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def markdown(rows: dict[str, dict[str, float]]) -> str:
    """One row per run: window, then seconds (share) per phase."""
    head = "| run | window s | " + " | ".join(PHASES) + " | training window s | val_blocking_training |"
    lines = [head, "|" + "---|" * (len(PHASES) + 4)]
    for name, split in rows.items():
        cells = [f"{split[p]:.1f} ({100 * split[f'{p}_frac']:.0f}%)" for p in PHASES]
        cells += [f"{split['training_window_s']:.1f}",
                  f"{split['val_blocking_training']:.1f} ({100 * split['val_blocking_training_frac']:.1f}%)"]
        lines.append(f"| {name} | {split['window_s']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    for suffix in (".tar.gz", ".tgz"):
        base = base.removesuffix(suffix)
    return base


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders or .tar.gz archives holding timeline.jsonl")
    args = parser.parse_args(argv)
    print(markdown({run_name(r): time_split(read_timeline(r)) for r in args.runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
