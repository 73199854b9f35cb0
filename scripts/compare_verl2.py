"""verl 0.9 vs verl_async on two GPUs (issue 37 item 3): one markdown table from the runs' archives.

    python scripts/compare_verl2.py RUN.tar.gz ... --out bench/verl_vs_ours_2gpu_table.md

Each RUN is a folder or a .tar.gz as scripts/device/verl_compare.sh archives a two-GPU phase (verl2async,
verl2v1, verl2sync, ours2split, ours2sync): console.log (every line prefixed with the time.time() it was
printed), launch_epoch, gpu_mem.csv (nvidia-smi's used MiB of each GPU every 0.5 s, the GPUs' lines in turn),
bench_info.json (system, recipe, layout, PPO updates per logged step), and verl's file-logger metrics.jsonl or our
tensorboard/ + timeline.jsonl. Parsing of verl's console and file logger: scripts/compare_verl.py.

Columns (every time in seconds; the training window runs from the first moment the trainer waits for samples
or the engine generates, to the weights of the last update existing):
  updates        PPO updates of 16 prompts x 8 responses (verl V1 separate_async logs one step per 4 updates)
  start-up       launch of the command to the training window (Ray, processes, engines, the first sync)
  trained tok/s  prompt + response tokens of every trained sample / window
  s/update       window / updates
  sync s         seconds per weight sync: ours `timing_s/param_sync`; verl's fully async recipe the trainer's
                 `timing_s/param_sync` lines (the one before training left out); verl main_ppo and V1
                 `timing_s/update_weights` per step
  trainer idle   ours: 1 - (train + log-prob spans) / window (timeline); verl's fully async recipe: its own
                 `fully_async/trainer/idle_ratio`, summed timing_s/gen / summed timing_s/step; verl V1 separate_async and
                 main_ppo: 1 - (step - gen - update_weights) / step from its step timers (marked "t")
  rollout idle   ours: 1 - (time with a request on an engine) / window; verl's fully async recipe: its own
                 `fully_async/rollouter/idle_ratio` weighted by each version's time; verl main_ppo: 1 - gen / step
                 (the engines sleep while the actor trains; "t"); verl V1 separate_async logs none ("-")
  peak MiB       the most nvidia-smi saw in use on each GPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from compare_verl import _fmt, _read, ours_run, parse_file_logger, parse_value, verl_run  # noqa: E402
from plot_runs import unpack_run  # noqa: E402

TS = r"^(?P<ts>\d+(?:\.\d+)?) "
ASYNC_START = re.compile(TS + r".*\[ASYNC MAIN\] Starting Rollouter and Trainer")
ASYNC_STEP = re.compile(TS + r".*\[FullyAsyncTrainer\] global_steps: (?P<step>\d+) local_trigger_step")
ASYNC_SYNC = re.compile(TS + r".*\[FullyAsyncTrainer\] _fit_update_weights, timing_s/param_sync: (?P<s>[^ ]+) seconds")


@dataclass
class Row:
    name: str
    system: str
    recipe: str
    layout: str
    updates: int
    startup_s: Optional[float]
    window_s: float
    trained_tokens: float
    sync_s: Optional[float]
    trainer_idle: Optional[float]
    rollout_idle: Optional[float]
    idle_from_timers: bool = False  # verl logs no idle ratio in this mode: derived from its step timers
    peak_mib: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def bench_info(folder: str) -> dict:
    text = _read(folder, "bench_info.json")
    return json.loads(text) if text.strip() else {}


def peaks_per_gpu(text: str, gpus: int) -> list[float]:
    """nvidia-smi's `memory.used` lines, the GPUs' lines in turn: the most each GPU held."""
    values = [parse_value(line.split(",")[0]) for line in text.splitlines() if line.strip()]
    values = [v for v in values if v is not None]
    return [max(values[i::gpus]) for i in range(gpus) if values[i::gpus]]


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def verl_async_row(name: str, folder: str, info: dict) -> Row:
    """verl's fully async recipe: times from the console, values from the file logger (one record per version)."""
    launch = float(_read(folder, "launch_epoch") or 0.0)
    lines = _read(folder, "console.log").splitlines()
    starts = [float(m["ts"]) for m in map(ASYNC_START.match, lines) if m]
    steps = [(float(m["ts"]), int(m["step"])) for m in map(ASYNC_STEP.match, lines) if m]
    syncs = [(float(m["ts"]), v) for m in map(ASYNC_SYNC.match, lines) if m and (v := parse_value(m["s"])) is not None]
    if not starts or not steps:
        raise SystemExit(f"{name}: no `[ASYNC MAIN] Starting Rollouter and Trainer` or no trainer step in console.log")
    start, last_step = starts[0], max(t for t, _ in steps)
    after = [t for t, _ in syncs if t >= last_step]
    end = min(after) if after else last_step  # the sync that follows the last update: its weights exist
    train_syncs = [s for t, s in syncs if start <= t <= end]
    records = parse_file_logger(_read(folder, "metrics.jsonl"))
    cycles = [m for m in records.values() if "timing_s/step" in m]
    tokens = sum(m.get("perf/total_num_tokens", 0.0) for m in cycles)
    covered = int(max((m.get("training/global_step", 0.0) for m in cycles), default=0))
    updates = len(steps) * int(info.get("updates_per_step", 1))  # a trainer step trains require_batches mini-batches
    row = Row(name, "verl", info.get("recipe", "async"), info.get("layout", "split 1+1"), updates,
              start - launch, end - start, tokens, _mean(train_syncs), None, None)
    if cycles:
        row.trainer_idle = sum(m.get("timing_s/gen", 0.0) for m in cycles) / sum(m["timing_s/step"] for m in cycles)
    if 0 < covered < len(steps):  # verl logs a cycle's metrics at the next sync: the last steps may be missing
        row.trained_tokens = tokens * len(steps) / covered
        row.notes.append(f"tokens of {len(steps) - covered} unlogged step(s) estimated from the {covered} logged")
    versions = [m for step, m in records.items() if step >= 1 and "fully_async/rollouter/version_time" in m]
    total = sum(m["fully_async/rollouter/version_time"] for m in versions)
    if total > 0:
        row.rollout_idle = sum(m["fully_async/rollouter/version_time"] * m.get("fully_async/rollouter/idle_ratio", 0.0)
                               for m in versions) / total
    return row


def verl_steps_row(name: str, folder: str, info: dict) -> Row:
    """verl main_ppo (V1 sync) or V1 separate_async: one console/file-logger step per weight version."""
    per_step = int(info.get("updates_per_step", 1))
    run = verl_run(name, folder, 16 * 8)
    step = run.split["gen"] + run.split["train"] + run.split["sync"]
    separate = info.get("recipe") == "v1"
    row = Row(name, "verl", info.get("recipe", "sync"), info.get("layout", ""), run.steps * per_step, run.window[0],
              run.window_s, run.trained_tokens, run.split["sync"], 1.0 - run.split["train"] / step,
              None if separate else 1.0 - run.split["gen"] / step, idle_from_timers=True)
    return row


def ours_row(name: str, folder: str, info: dict) -> Row:
    from verl_async.utils.tb_read import read_scalars
    from verl_async.utils.timeline import timeline_metrics

    run = ours_run(name, folder, 16 * 8)
    timeline = timeline_metrics(folder)
    syncs = [p.value for p in read_scalars(folder).get("timing_s/param_sync", [])]
    return Row(name, "ours", info.get("recipe", ""), info.get("layout", ""), run.steps, run.window[0], run.window_s,
               run.trained_tokens, _mean(syncs), timeline["trainer_idle_ratio"], timeline["rollout_idle_ratio"])


def load(path: str, scratch: str) -> Row:
    name, folder = unpack_run(path, scratch)
    info = bench_info(folder)
    if info.get("system") == "ours" or os.path.exists(os.path.join(folder, "timeline.jsonl")):
        row = ours_row(name, folder, info)
    elif info.get("recipe") == "async" or "[FullyAsyncTrainer]" in _read(folder, "console.log"):
        row = verl_async_row(name, folder, info)
    else:
        row = verl_steps_row(name, folder, info)
    row.peak_mib = peaks_per_gpu(_read(folder, "gpu_mem.csv"), int(info.get("gpus", 1)))
    if not _read(folder, "launch_epoch").strip():  # a run folder not launched by verl_compare.sh: no launch time
        row.startup_s = None
    return row


def table(rows: Sequence[Row]) -> str:
    head = ["run", "system", "recipe", "layout", "updates", "start-up s", "trained tok/s", "s/update",
            "sync s", "trainer idle", "rollout idle", "peak MiB per GPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mark = " t" if r.idle_from_timers else ""
        idle = [_fmt(r.trainer_idle, 2) + (mark if r.trainer_idle is not None else ""),
                _fmt(r.rollout_idle, 2) + (mark if r.rollout_idle is not None else "")]
        cells = [r.name, r.system, r.recipe, r.layout, str(r.updates), _fmt(r.startup_s),
                 _fmt(r.trained_tokens / r.window_s if r.window_s > 0 else None, 0),
                 _fmt(r.window_s / r.updates if r.updates else None, 2), _fmt(r.sync_s, 3), *idle,
                 " / ".join(_fmt(p, 0) for p in r.peak_mib) or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r.name}: {n}" for r in rows for n in r.notes]
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders or .tar.gz archives (verl's and ours)")
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        rows = [load(p, scratch) for p in args.runs]
    text = table(rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
