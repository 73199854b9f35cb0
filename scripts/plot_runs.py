"""Learning curves and a comparison table of finished runs, from their TensorBoard logs and timelines.

    python scripts/plot_runs.py RUN [RUN ...] --out-dir bench --prefix real_model

RUN: a run folder (trainer.default_local_dir: tensorboard/, timeline.jsonl) or a `.tar.gz` of one
(as scripts/device/real_model_gpu.sh returns them); its name is the folder/archive name
(`sync-1`, `async-2`: the part before the last `-` groups seeds of one configuration).
Writes:
  PREFIX_accuracy.png   held-out accuracy vs trained samples and vs wall time (seconds since the
                        first validation, i.e. since training started)
  PREFIX_curves.png     reward, train accuracy, response length, entropy, KL loss, grad norm per step
  PREFIX_table.md       wall time, trained tokens/s, idle ratios, accuracy (first/last/best) per run,
                        and per configuration the mean and spread of the final accuracy over seeds
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_async.utils.tb_read import Point, read_scalars  # noqa: E402
from verl_async.utils.timeline import timeline_metrics  # noqa: E402

VAL_ACC = "val/mean@1/acc"
CURVES = (
    ("critic/score/mean", "reward (mean score)"),
    ("critic/acc/mean", "train accuracy"),
    ("response_length/mean", "response length (tokens)"),
    ("actor/entropy", "entropy"),
    ("actor/kl_loss", "KL loss (low_var_kl)"),
    ("actor/grad_norm", "grad norm"),
)


@dataclass
class Run:
    name: str
    scalars: dict[str, list[Point]]
    timeline: dict[str, float] = field(default_factory=dict)

    @property
    def config(self) -> str:
        return self.name.rsplit("-", 1)[0] if "-" in self.name else self.name

    def series(self, tag: str) -> list[Point]:
        return self.scalars.get(tag, [])


def unpack_run(path: str, scratch: str) -> tuple[str, str]:
    """(name, folder) of a run folder, or of a .tar.gz of one unpacked into `scratch`."""
    name = os.path.basename(path.rstrip("/"))
    if name.endswith(".tar.gz"):
        name = name[: -len(".tar.gz")]
        folder = os.path.join(scratch, name)
        os.makedirs(folder, exist_ok=True)
        with tarfile.open(path) as tar:
            tar.extractall(folder, filter="data")
        path = folder
    return name, path


def load_run(path: str, scratch: str) -> Run:
    """A run folder, or a .tar.gz of one unpacked into `scratch`."""
    name, path = unpack_run(path, scratch)
    scalars = read_scalars(path)
    if not scalars:
        raise SystemExit(f"{path}: no TensorBoard scalars (is tensorboard/ there?)")
    timeline: dict[str, float] = {}
    if os.path.exists(os.path.join(path, "timeline.jsonl")):
        try:
            timeline = timeline_metrics(path)
        except RuntimeError as exc:  # a run that trained nothing
            print(f"warning: {exc}", file=sys.stderr)
    return Run(name, scalars, timeline)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(runs: list[Run], out: str, per_step: float) -> None:
    plt = _pyplot()
    fig, (by_samples, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = _colors(runs)
    for run in runs:
        points = run.series(VAL_ACC)
        if not points:
            continue
        t0 = points[0].wall_time
        style = dict(color=colors[run.config], marker="o", ms=3, label=run.name, alpha=0.9)
        by_samples.plot([p.step * per_step for p in points], [p.value for p in points], **style)
        by_time.plot([p.wall_time - t0 for p in points], [p.value for p in points], **style)
    by_samples.set(xlabel="trained samples (responses)", ylabel=f"held-out accuracy ({VAL_ACC}, greedy)")
    by_time.set(xlabel="wall time since training started (s)", ylabel="held-out accuracy")
    for ax in (by_samples, by_time):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_curves(runs: list[Run], out: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    colors = _colors(runs)
    for ax, (tag, title) in zip(axes.flat, CURVES):
        for run in runs:
            points = [p for p in run.series(tag) if math.isfinite(p.value)]
            if points:
                ax.plot([p.step for p in points], [p.value for p in points], color=colors[run.config],
                        label=run.name, lw=1.2, alpha=0.85)
        ax.set(title=title, xlabel="trainer step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _colors(runs: list[Run]) -> dict[str, str]:
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
               "tab:olive", "tab:cyan"]
    configs = sorted({r.config for r in runs})
    return {c: palette[i % len(palette)] for i, c in enumerate(configs)}


def _last(run: Run, tag: str) -> float:
    points = run.series(tag)
    return points[-1].value if points else float("nan")


def _mean(run: Run, tag: str) -> float:
    values = [p.value for p in run.series(tag) if math.isfinite(p.value)]
    return sum(values) / len(values) if values else float("nan")


def table(runs: list[Run], per_step: float) -> str:
    head = ("| run | steps | trained samples | wall s | trained tok/s | rollout idle | trainer idle | "
            "val acc start | val acc end | best | staleness mean | logprob gap mean / max |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for run in runs:
        acc = run.series(VAL_ACC)
        steps = max((p.step for p in run.series("critic/score/mean")), default=0)
        tl = run.timeline
        rows.append(
            f"| {run.name} | {steps} | {steps * per_step:.0f} | {tl.get('wall_s', float('nan')):.0f} "
            f"| {tl.get('trained_tokens_per_s', float('nan')):.0f} | {tl.get('rollout_idle_ratio', float('nan')):.2f} "
            f"| {tl.get('trainer_idle_ratio', float('nan')):.2f} "
            f"| {acc[0].value if acc else float('nan'):.3f} | {acc[-1].value if acc else float('nan'):.3f} "
            f"| {max((p.value for p in acc), default=float('nan')):.3f} "
            f"| {_mean(run, 'fully_async/staleness/mean'):.2f} "
            f"| {_mean(run, 'mismatch/train_rollout_logprob_abs_diff'):.2e} / "
            f"{max((p.value for p in run.series('mismatch/train_rollout_logprob_abs_diff_max')), default=float('nan')):.2e} |"
        )
    rows += ["", "| configuration | seeds | final val acc (mean ± half range) | wall s (mean) |", "|---|---|---|---|"]
    by_config: dict[str, list[Run]] = {}
    for run in runs:
        by_config.setdefault(run.config, []).append(run)
    for config, members in sorted(by_config.items()):
        finals = [_last(r, VAL_ACC) for r in members]
        walls = [r.timeline.get("wall_s", float("nan")) for r in members]
        spread = (max(finals) - min(finals)) / 2 if len(finals) > 1 else float("nan")
        rows.append(f"| {config} | {len(members)} | {statistics.fmean(finals):.3f} ± {spread:.3f} "
                    f"| {statistics.fmean(walls):.0f} |")
    return "\n".join(rows) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders or .tar.gz archives of them")
    p.add_argument("--out-dir", default="bench")
    p.add_argument("--prefix", default="runs")
    p.add_argument("--samples-per-step", type=float, default=128.0,
                   help="responses per trainer step (ppo_mini_batch_size x rollout.n x require_batches)")
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        runs = sorted((load_run(r, scratch) for r in args.runs), key=lambda r: r.name)
    base = os.path.join(args.out_dir, args.prefix)
    plot_accuracy(runs, f"{base}_accuracy.png", args.samples_per_step)
    plot_curves(runs, f"{base}_curves.png")
    text = table(runs, args.samples_per_step)
    with open(f"{base}_table.md", "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {base}_accuracy.png, {base}_curves.png, {base}_table.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
