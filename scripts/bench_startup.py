"""Start-up of a CPU run through the entry point: the command typed to the first generated token.

    python scripts/bench_startup.py [--repeat 3] [--checkout DIR] [--phases] [--demo] [-- key=value ...]

Runs `python -m recipe.fully_async_main` (the built-in CPU demo on builtin://tiny-random, shortened: no
validation, 8 prompts)
as a user would, from DIR (default: this checkout, so an older tree can be measured beside it), and
reports per run:

  to_run_start   the command started -> `pipeline.run` began (interpreter, Hydra, validation, preflight)
  to_first_token `pipeline.run` began -> the first generation started (Ray, the actors and their
                 imports, the model on every side, the first weight sync): the timeline's `startup_s`
  total          the sum: the command typed to the first generated token
  first_step     `pipeline.run` began -> the first training step ended
  wall           the whole process (the short run and the teardown included)

and, where the tree records it (utils/startup.py), the median of every start-up phase (`startup/<who>/<phase>`)
in a second table (`--phases`).

The timeline's times are relative to `pipeline.run`'s start, so this script watches
`<run>/timeline.jsonl` while the run goes: the first `generate` line seen at time T with span end E
puts the run's start at T - E (within the 20 ms poll). The numbers are wall seconds on this machine;
compare two trees in the same call (they alternate), since a loaded machine inflates both.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from verl_async.utils.startup import startup_breakdown  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# builtin://tiny-random: the demo's shape without its one-time warm-start (a cache build, not start-up)
SHORT_RUN = ("actor_rollout_ref.model.path=builtin://tiny-random", "trainer.val_before_train=false", "trainer.test_freq=-1", "rollout.total_rollout_steps=8",
             "trainer.logger=[console]", "trainer.save_freq=-1")


def first_generate(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            for line in f:
                if line.strip():
                    span = json.loads(line)
                    if span["kind"] == "generate":
                        return span
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return None


def trained(path: str) -> bool:
    try:
        with open(path) as f:
            return any('"kind": "train"' in line for line in f)
    except FileNotFoundError:
        return False


def measure(checkout: str, extra: list[str], python: str, timeout: float, demo: bool = False) -> dict[str, float]:
    """One run; `demo`: the CPU demo as configured (no short-run overrides), stopped by Ctrl-C once it trained a step."""
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as work:
        run_dir = os.path.join(work, "run")
        cmd = [python, "-m", "recipe.fully_async_main", *(() if demo else SHORT_RUN), f"trainer.default_local_dir={run_dir}",
               *extra]
        timeline = os.path.join(run_dir, "timeline.jsonl")
        env = dict(os.environ, PYTHONPATH=checkout)
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        run_start = None
        log: list[str] = []
        import threading

        reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
        reader.start()
        interrupted = False
        while proc.poll() is None and time.time() - t0 < timeout:
            if run_start is None:
                span = first_generate(timeline)
                if span is not None:
                    run_start = time.time() - span["end"]
            elif demo and not interrupted and trained(timeline):
                proc.send_signal(signal.SIGINT)  # the entry point's Ctrl-C: one line, Ray shut down
                interrupted = True
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
            reader.join(timeout=5)
            raise RuntimeError(f"the run did not end within {timeout:.0f} s:\n{''.join(log[-30:])}")
        wall = time.time() - t0
        reader.join(timeout=10)
        if proc.returncode not in ((0, 130) if demo else (0,)) or run_start is None:
            raise RuntimeError(f"run failed (exit {proc.returncode}):\n{''.join(log[-30:])}")
        spans = [json.loads(line) for line in open(timeline) if line.strip()]
        first = min(s["start"] for s in spans if s["kind"] == "generate")
        step = min((s["end"] for s in spans if s["kind"] == "train"), default=float("nan"))
    phases = {k: v for k, v in startup_breakdown(spans).items() if k.count("/") == 2}
    return {"to_run_start": run_start - t0, "to_first_token": first, "total": run_start - t0 + first,
            "first_step": step, "wall": wall, **phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--checkout", action="append", default=None,
                        help="a tree to measure (repeatable: the trees alternate run by run); default this one")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--phases", action="store_true", help="also the median of every start-up phase")
    parser.add_argument("--demo", action="store_true",
                        help="the CPU demo itself (no short-run overrides), stopped once it trained its first step")
    parser.add_argument("--json", default=None, help="write every run's numbers here")
    parser.add_argument("overrides", nargs="*", help="key=value overrides after the short run's")
    args = parser.parse_args()
    trees = [os.path.abspath(c) for c in (args.checkout or [REPO])]
    results: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for i in range(args.repeat):
        for tree in trees:
            r = measure(tree, args.overrides, args.python, args.timeout, demo=args.demo)
            results[tree].append(r)
            print(f"{tree} run {i + 1}: " + ", ".join(f"{k}={v:.1f}s" for k, v in r.items() if "/" not in k),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("\n| tree | runs | to_run_start | to_first_token | total (median) | first_step | wall |\n"
          "|---|---|---|---|---|---|---|")
    medians = {tree: {k: statistics.median(r.get(k, float("nan")) for r in rs) for k in rs[0]}
               for tree, rs in results.items()}
    for tree, med in medians.items():
        print(f"| {tree} | {len(results[tree])} | {med['to_run_start']:.1f} | {med['to_first_token']:.1f} | "
              f"{med['total']:.1f} | {med['first_step']:.1f} | {med['wall']:.1f} |")
    if args.phases:
        keys = sorted({k for med in medians.values() for k in med if "/" in k})
        print("\n| phase (median s) | " + " | ".join(medians) + " |\n|---|" + "---|" * len(medians))
        for key in keys:
            print(f"| {key[len('startup/'):]} | " + " | ".join(f"{med.get(key, float('nan')):.2f}"
                                                        for med in medians.values()) + " |")


if __name__ == "__main__":
    main()
