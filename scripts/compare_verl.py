"""verl 0.9 vs verl_async on the same job (issue 27): one markdown table and a PNG of accuracy vs wall time.

    python scripts/compare_verl.py --verl verl-1.tar.gz verl-2.tar.gz --ours ours-1.tar.gz ours-2.tar.gz \\
        --out-dir bench --prefix verl_vs_ours_h100 [--thresholds 0.3 0.45] [--throughput]

Each RUN is a folder or a .tar.gz as scripts/device/verl_compare.sh archives it: `console.log` (every line
prefixed with the time.time() it was printed), `launch_epoch`, `gpu_mem.csv` (nvidia-smi's used MiB every
0.5 s), and verl's file-logger `metrics.jsonl` or our `tensorboard/` + `timeline.jsonl`.

verl's console logger prints `step:N - key:value - ...` (values through pprint, so numpy scalars read
`np.float64(0.25)`); inside Ray the line is prefixed `(TaskRunner pid=..)`. Values come from the file
logger (`{"step": N, "data": {...}}`) where it exists, times from the console. verl validates at the end
of a step and prints that step's line after it: the weights of step N exist at the line's time minus
`timing_s/testing`. Ours: the weights of version N exist when the step metrics of version N were logged
(TensorBoard wall time of `fully_async/param_version`), whenever its validation finished.

Columns (time in seconds from the launch of the command, start-up included):
  first step    the training window's start: start-up (Ray, processes, engines) and the validation before training
  to acc>=T     first validated version whose held-out accuracy (verl `val-core/*/acc/mean@1`, ours
                `val/mean@1/acc`) reached T; "-" never
  final acc     the last validation's accuracy
  trained tok/s prompt+response tokens of every trained sample / training window (first training
                generation to the last step's weights)
  gen tok/s     response tokens of every trained sample / the same window
  s/step        training window / steps, then per step: generation, training, weight sync, validation
                holding the trainer, trainer waiting for groups (verl: 0, its generation is on the step's
                path; ours overlaps generation with training, so the parts exceed s/step)
  peak GPU MiB  the most nvidia-smi saw in use during the run (engines and trainer together)
--throughput leaves the accuracy columns out (the random-weight runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from plot_runs import _pyplot, unpack_run  # noqa: E402
from time_split import read_timeline, time_split  # noqa: E402

OURS_ACC = "val/mean@1/acc"
VERL_ACC = re.compile(r"^val-core/.+/acc/mean@1$")
VERL_REWARD = re.compile(r"^val-core/.+/reward/mean@1$")
STEP_LINE = re.compile(r"^(?:(?P<ts>\d+(?:\.\d+)?) )?.*?\bstep:(?P<step>\d+)(?P<rest>(?: - .*)?)$")
NUMBER = re.compile(r"^(?:np\.\w+\()?(?P<num>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf))\)?$")


# ------------------------------------------------------------------------------------- parsing
def parse_value(text: str) -> Optional[float]:
    """A number as verl's console prints it (`0.25`, `np.float64(0.25)`, `nan`, `True`); None otherwise."""
    text = text.strip()
    if text in ("True", "False"):
        return float(text == "True")
    match = NUMBER.match(text)
    return float(match.group("num")) if match else None


@dataclass
class ConsoleStep:
    ts: Optional[float]  # the time.time() prefix, None without one
    step: int
    metrics: dict[str, float]


def parse_verl_console(text: str) -> list[ConsoleStep]:
    """Every `step:N - key:value ...` line of verl's console logger, in order."""
    out = []
    for line in text.splitlines():
        match = STEP_LINE.match(line.strip())
        if not match:
            continue
        metrics = {}
        for item in match.group("rest").split(" - ")[1:]:
            key, sep, value = item.rpartition(":")
            number = parse_value(value) if sep else None
            if key and number is not None:
                metrics[key] = number
        out.append(ConsoleStep(float(match.group("ts")) if match.group("ts") else None, int(match.group("step")),
                               metrics))
    return out


def parse_file_logger(text: str) -> dict[int, dict[str, float]]:
    """verl's (and our) file logger: {step: numeric metrics}, several lines of one step merged."""
    out: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        if line.strip():
            record = json.loads(line)
            data = {k: float(v) for k, v in record["data"].items() if isinstance(v, (int, float)) and v is not None}
            out.setdefault(int(record["step"]), {}).update(data)
    return out


def verl_accuracy_key(metrics: dict[str, float]) -> Optional[str]:
    for pattern in (VERL_ACC, VERL_REWARD):
        keys = sorted(k for k in metrics if pattern.match(k))
        if keys:
            return keys[0]
    return None


def peak_mib(text: str) -> Optional[float]:
    values = [parse_value(line.split(",")[0]) for line in text.splitlines() if line.strip()]
    values = [v for v in values if v is not None]
    return max(values) if values else None


# ------------------------------------------------------------------------------------- one run
@dataclass
class RunData:
    name: str
    system: str  # verl | ours
    acc: list[tuple[float, int, float]] = field(default_factory=list)  # (s since launch, version/step, accuracy)
    steps: int = 0
    window: tuple[float, float] = (0.0, 0.0)  # training window, s since launch
    trained_tokens: float = 0.0
    generated_tokens: float = 0.0
    split: dict[str, float] = field(default_factory=dict)  # seconds per step: gen, train, sync, val, wait
    peak_mib: Optional[float] = None

    @property
    def window_s(self) -> float:
        return self.window[1] - self.window[0]


def _read(folder: str, name: str) -> str:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def verl_run(name: str, folder: str, responses_per_step: int) -> RunData:
    """RunData of a verl run from its console (times) and file logger (values)."""
    launch = float(_read(folder, "launch_epoch") or 0.0)
    console = parse_verl_console(_read(folder, "console.log"))
    values = parse_file_logger(_read(folder, "metrics.jsonl"))
    run = RunData(name, "verl", peak_mib=peak_mib(_read(folder, "gpu_mem.csv")))
    ends: dict[int, float] = {}
    steps: dict[int, dict[str, float]] = {}
    for line in console:
        metrics = {**line.metrics, **values.get(line.step, {})}
        testing = metrics.get("timing_s/testing", 0.0)
        if line.ts is not None:
            ends[line.step] = line.ts - launch - testing  # the weights of this step existed then
        if "timing_s/step" in metrics:
            steps[line.step] = metrics
        key = verl_accuracy_key(metrics)
        if key is not None and line.step in ends:
            run.acc.append((ends[line.step], line.step, metrics[key]))
    if not steps:
        raise SystemExit(f"{name}: no training step in console.log (`step:N - ... timing_s/step:...`)")
    first, last = min(steps), max(steps)
    run.steps = len(steps)
    run.window = (ends.get(first, 0.0) - steps[first]["timing_s/step"], ends.get(last, 0.0))
    run.trained_tokens = sum(m.get("perf/total_num_tokens", 0.0) for m in steps.values())
    run.generated_tokens = sum(m.get("response_length/mean", 0.0) * responses_per_step for m in steps.values())
    gen = [m.get("timing_s/gen", 0.0) for m in steps.values()]
    sync = [m.get("timing_s/update_weights", 0.0) for m in steps.values()]
    run.split = {
        "gen": statistics.fmean(gen),
        "train": statistics.fmean(m["timing_s/step"] - g - s for m, g, s in zip(steps.values(), gen, sync)),
        "sync": statistics.fmean(sync),
        "val": sum(m.get("timing_s/testing", 0.0) for m in steps.values()) / len(steps),
        "wait": 0.0,
    }
    return run


def ours_run(name: str, folder: str, responses_per_step: int) -> RunData:
    """RunData of a verl_async run from its TensorBoard scalars and timeline."""
    from verl_async.utils.tb_read import read_scalars

    launch = float(_read(folder, "launch_epoch") or 0.0)
    scalars = read_scalars(folder)
    if "fully_async/param_version" not in scalars:
        raise SystemExit(f"{name}: no TensorBoard scalars of a verl_async run in {folder}")
    ready = {p.step: p.wall_time - launch for p in scalars["fully_async/param_version"]}
    run = RunData(name, "ours", peak_mib=peak_mib(_read(folder, "gpu_mem.csv")))
    for p in scalars.get(OURS_ACC, []):
        run.acc.append((ready.get(p.step, p.wall_time - launch), p.step, p.value))  # version 0: when it was logged
    spans = read_timeline(folder)
    run_start = _run_start(folder, scalars, spans, launch)
    gen_start = min(s["start"] for s in spans if s["kind"] == "generate")
    run.steps = len(scalars.get("timing_s/step", []))
    run.window = (run_start + gen_start, max(ready.values()))
    run.trained_tokens = float(sum(s["info"].get("tokens", 0) for s in spans
                                   if s["kind"] == "train" and s["lane"].startswith("trainer")))
    run.generated_tokens = sum(p.value * responses_per_step for p in scalars.get("response_length/mean", []))
    split = time_split(spans)
    steps = max(run.steps, 1)
    run.split = {"gen": split["generation"] / steps, "train": split["training"] / steps,
                 "sync": split["sync"] / steps, "val": split["val_blocking"] / steps,
                 "wait": split["trainer_wait"] / steps}
    return run


def _run_start(folder: str, scalars: dict, spans: Sequence[dict], launch: float) -> float:
    """Seconds from launch to the run's own clock zero (timeline times count from it): the step metrics of
    version v were logged right after the sync span of v ended, so the two clocks meet there."""
    ends = {s["version"]: s["end"] for s in spans if s["kind"] == "sync"}
    offsets = [p.wall_time - launch - ends[p.step] for p in scalars["fully_async/param_version"] if p.step in ends]
    return min(offsets) if offsets else 0.0


# ------------------------------------------------------------------------------------- the table
def time_to(points: Sequence[tuple[float, int, float]], threshold: float) -> Optional[float]:
    """Seconds since launch at which a validated model first reached `threshold` (None: never)."""
    hits = [t for t, _, acc in sorted(points) if acc >= threshold - 1e-12]
    return hits[0] if hits else None


def _fmt(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def table(runs: Sequence[RunData], thresholds: Sequence[float], throughput: bool = False) -> str:
    """One row per run (see the module docstring for the columns)."""
    head = ["run", "system", "steps", "first step (s)"]
    if not throughput:
        head += [f"to acc>={t:g} (s)" for t in thresholds] + ["final acc", "best acc"]
    head += ["trained tok/s", "gen tok/s", "s/step", "gen", "train", "sync", "val", "wait", "peak GPU MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [r.name, r.system, str(r.steps), _fmt(r.window[0] if r.window_s > 0 else None)]
        if not throughput:
            cells += [_fmt(time_to(r.acc, t)) for t in thresholds]
            final = sorted(r.acc)[-1][2] if r.acc else None
            cells += [_fmt(final, 3), _fmt(max((a for _, _, a in r.acc), default=None), 3)]
        per_step = r.window_s / r.steps if r.steps else None
        cells += [_fmt(r.trained_tokens / r.window_s if r.window_s > 0 else None, 0),
                  _fmt(r.generated_tokens / r.window_s if r.window_s > 0 else None, 0), _fmt(per_step, 2)]
        cells += [_fmt(r.split.get(k), 2) for k in ("gen", "train", "sync", "val", "wait")]
        cells.append(_fmt(r.peak_mib, 0))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: Sequence[RunData], out: str) -> None:
    """Held-out accuracy vs wall time since launch, one line per run (verl dashed)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in runs:
        points = sorted(r.acc)
        ax.plot([t for t, _, _ in points], [a for _, _, a in points], marker="o", markersize=3,
                linestyle="--" if r.system == "verl" else "-", label=r.name)
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("held-out accuracy (greedy, mean@1)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl", nargs="*", default=[], help="verl runs (folders or .tar.gz)")
    parser.add_argument("--ours", nargs="*", default=[], help="verl_async runs (folders or .tar.gz)")
    parser.add_argument("--out-dir", default="bench")
    parser.add_argument("--prefix", default="verl_vs_ours")
    parser.add_argument("--thresholds", nargs="+", type=float, default=[0.3, 0.45])
    parser.add_argument("--responses-per-step", type=int, default=16 * 8, help="prompts per step x n")
    parser.add_argument("--throughput", action="store_true", help="no accuracy columns and no plot")
    args = parser.parse_args(argv)
    if not args.verl and not args.ours:
        parser.error("give --verl and/or --ours runs")
    os.makedirs(args.out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        runs = [verl_run(*unpack_run(p, scratch), args.responses_per_step) for p in args.verl]
        runs += [ours_run(*unpack_run(p, scratch), args.responses_per_step) for p in args.ours]
    text = table(runs, args.thresholds, args.throughput)
    with open(os.path.join(args.out_dir, f"{args.prefix}_table.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    if not args.throughput:
        plot(runs, os.path.join(args.out_dir, f"{args.prefix}_accuracy.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
