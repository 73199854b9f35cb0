"""Where runs' start-up went, side by side: the start-up breakdown (verl_async/utils/startup.py) of each run.

    python scripts/startup_report.py RUN [RUN ...] [--labels a,b,...] [--json OUT]

RUN: a run folder (its timeline.jsonl), a timeline.jsonl, or a .tar.gz archive of run folders (the device
scripts' archives: every timeline.jsonl inside is one run, named by its folder). Prints one markdown table: the
milestones (seconds after the run started: first sync, first generated token, first trained step; the command's
part before the run), then every `<who>/<phase>` in seconds. Runs without start-up spans (older trees) show their
milestones only.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from verl_async.utils.startup import MILESTONES, lane_sort_key, startup_breakdown  # noqa: E402


def spans_of(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def runs_in(path: str) -> list[tuple[str, list[dict]]]:
    """(name, spans) of every run `path` holds."""
    if path.endswith((".tar.gz", ".tgz")):
        out = []
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if os.path.basename(member.name) == "timeline.jsonl":
                    folder = os.path.dirname(member.name).strip("./") or os.path.basename(path).split(".tar")[0]
                    text = io.TextIOWrapper(tar.extractfile(member), encoding="utf-8").read()
                    out.append((folder, spans_of(text)))
        return sorted(out)
    file = path if path.endswith(".jsonl") else os.path.join(path, "timeline.jsonl")
    with open(file) as f:
        return [(os.path.basename(os.path.dirname(os.path.abspath(file))), spans_of(f.read()))]


def first_starts(spans: list[dict]) -> dict[str, float]:
    """When each `startup/<who>/<phase>` first began: the table lists a process's phases in the order they ran."""
    out: dict[str, float] = {}
    for s in spans:
        if s["kind"] == "startup":
            key = f"startup/{s['lane'].split('/', 1)[-1]}/{s['info'].get('phase', '?')}"
            out[key] = min(out.get(key, float("inf")), float(s["start"]))
    return out


def table(named: list[tuple[str, dict[str, float]]], order: dict[str, float]) -> str:
    keys = {k for _, b in named for k in b}
    milestones = [f"startup/{m}" for m in MILESTONES if f"startup/{m}" in keys]
    phases = sorted((k for k in keys if k.count("/") == 2 and k.split("/")[2] not in MILESTONES),
                    key=lambda k: (lane_sort_key(k.split("/")[1]), order.get(k, float("inf")), k))
    lines = ["| seconds | " + " | ".join(name for name, _ in named) + " |", "|---|" + "---|" * len(named)]
    for key in milestones + phases:
        cells = [f"{b[key]:.2f}" if key in b else "" for _, b in named]
        label = f"**{key[len('startup/'):]}**" if key in milestones else key[len("startup/"):]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--labels", default=None, help="comma list, one per run found (default: folder names)")
    parser.add_argument("--json", default=None, help="write {run: breakdown} here")
    args = parser.parse_args()
    found = [(name, spans) for path in args.runs for name, spans in runs_in(path)]
    named = [(name, startup_breakdown(spans)) for name, spans in found]
    order: dict[str, float] = {}
    for _, spans in found:
        for key, start in first_starts(spans).items():
            order.setdefault(key, start)
    if args.labels:
        labels = args.labels.split(",")
        if len(labels) != len(named):
            parser.error(f"--labels has {len(labels)} names for {len(named)} runs ({', '.join(n for n, _ in named)})")
        named = [(label, b) for label, (_, b) in zip(labels, named)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(named), f, indent=1)
    print(table(named, order))


if __name__ == "__main__":
    main()
