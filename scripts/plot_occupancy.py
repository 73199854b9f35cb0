"""Engine occupancy over time, one panel per run: where the rollout side waits, seen (not a test).

    python scripts/plot_occupancy.py RUN_DIR [RUN_DIR ...] --out bench/two_gpu_occupancy.png
    python scripts/plot_occupancy.py --bench bench/two_gpu/bench_async_0.5b_h200x2.json --out bench/two_gpu_tokps.png

A run folder's `timeline.jsonl` holds one `generate` span per engine request, the trainer's `train` /
`logprob` spans and the Rollouter's admission holds (`hold_budget`: the staleness budget is spent until
the next sync). Each panel draws the generation requests running at each moment (the engine is
underfed where the curve sags), the trainer's busy spans as a band under it and the budget holds as a
band over it. `--bench` draws a bench_async.py JSON as bars: trained tokens/s and the idle ratios per config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def running_requests(spans: Iterable[tuple[float, float]]) -> tuple[list[float], list[int]]:
    """Step function of how many intervals are open: times and counts (the count holds from each time on)."""
    events: list[tuple[float, int]] = []
    for start, end in spans:
        if end > start:
            events += [(start, 1), (end, -1)]
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    times, counts, level = [], [], 0
    for t, delta in events:
        level += delta
        if times and times[-1] == t:
            counts[-1] = level
        else:
            times.append(t)
            counts.append(level)
    return times, counts


def plot_runs(run_dirs: Sequence[str], out: str, labels: Sequence[str] = ()) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verl_async.utils.timeline import read_spans

    fig, axes = plt.subplots(len(run_dirs), 1, figsize=(12, 2.6 * len(run_dirs)), squeeze=False)
    for ax, run_dir, label in zip(axes[:, 0], run_dirs, list(labels) + [None] * len(run_dirs)):
        spans = read_spans(os.path.join(run_dir, "timeline.jsonl"))
        gen = [(s["start"], s["end"]) for s in spans if s["kind"] == "generate"]
        t0 = min(s for s, _ in gen)
        times, counts = running_requests((s - t0, e - t0) for s, e in gen)
        ax.step(times, counts, where="post", color="#4c9be8", lw=0.8, label="generation requests running")
        top = max(counts) if counts else 1
        for s in spans:
            if s["lane"].startswith("trainer") and s["kind"] in ("train", "logprob"):
                ax.axvspan(s["start"] - t0, s["end"] - t0, ymin=0, ymax=0.06, color="#e8964c", lw=0)
            elif s["kind"] == "hold_budget":
                ax.axvspan(s["start"] - t0, s["end"] - t0, ymin=0.94, ymax=1.0, color="#d0453a", lw=0)
            elif s["kind"] == "sync":
                ax.axvline(s["start"] - t0, color="#888", lw=0.4)
        ax.set_ylim(0, top * 1.1)
        ax.set_xlim(left=0)
        ax.set_ylabel("requests")
        ax.set_title(label or os.path.basename(os.path.normpath(run_dir)), fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("seconds from the first generated token  (orange: trainer busy; red: staleness budget "
                           "spent, no group may start; grey: syncs)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def plot_bench(bench_json: str, out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(bench_json) as f:
        record = json.load(f)
    rows = [r for r in record["results"] if "error" not in r]
    names = [r["config"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.6))
    a.bar(names, [r["trained_tokens_per_s"] for r in rows], color="#4c9be8")
    a.set_ylabel("trained tokens/s")
    a.set_title(f"{record.get('device', '')}: {record['args'].get('shape', '0.5b')} shape, long tail", fontsize=10)
    width = 0.4
    xs = range(len(rows))
    b.bar([x - width / 2 for x in xs], [r["rollout_idle_ratio"] for r in rows], width, label="rollout idle")
    b.bar([x + width / 2 for x in xs], [r["trainer_idle_ratio"] for r in rows], width, label="trainer idle")
    b.set_xticks(list(xs), names)
    b.axhline(0.1, color="#888", lw=0.6, ls="--")
    b.set_ylim(0, 1)
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dirs", nargs="*")
    p.add_argument("--labels", default="", help="comma list, one per run dir")
    p.add_argument("--bench", default=None, help="a bench_async.py JSON: bars instead of occupancy")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.bench:
        print(plot_bench(args.bench, args.out))
    elif args.run_dirs:
        print(plot_runs(args.run_dirs, args.out, [x for x in args.labels.split(",") if x]))
    else:
        p.error("give run folders or --bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
