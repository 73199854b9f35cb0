"""Start-up of a CPU run through the entry point: the command typed to the first generated token.

    python scripts/bench_startup.py [--repeat 3] [--checkout DIR] [-- key=value ...]

Runs `python -m recipe.fully_async_main` (the built-in CPU demo on builtin://tiny-random, shortened: no
validation, 8 prompts)
as a user would, from DIR (default: this checkout, so an older tree can be measured beside it), and
reports per run:

  to_run_start   the command started -> `pipeline.run` began (interpreter, Hydra, validation, preflight)
  to_first_token `pipeline.run` began -> the first generation started (Ray, the actors and their
                 imports, the model on every side, the first weight sync): the timeline's `startup_s`
  total          the sum: the command typed to the first generated token
  wall           the whole process (the short run and the teardown included)

The timeline's times are relative to `pipeline.run`'s start, so this script watches
`<run>/timeline.jsonl` while the run goes: the first `generate` line seen at time T with span end E
puts the run's start at T - E (within the 20 ms poll). The numbers are wall seconds on this machine;
compare two trees in the same call (they alternate), since a loaded machine inflates both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

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


def measure(checkout: str, extra: list[str], python: str, timeout: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as work:
        run_dir = os.path.join(work, "run")
        cmd = [python, "-m", "recipe.fully_async_main", *SHORT_RUN, f"trainer.default_local_dir={run_dir}", *extra]
        timeline = os.path.join(run_dir, "timeline.jsonl")
        env = dict(os.environ, PYTHONPATH=checkout)
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        run_start = None
        log: list[str] = []
        import threading

        reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
        reader.start()
        while proc.poll() is None and time.time() - t0 < timeout:
            if run_start is None:
                span = first_generate(timeline)
                if span is not None:
                    run_start = time.time() - span["end"]
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
            reader.join(timeout=5)
            raise RuntimeError(f"the run did not end within {timeout:.0f} s:\n{''.join(log[-30:])}")
        wall = time.time() - t0
        reader.join(timeout=10)
        if proc.returncode != 0 or run_start is None:
            raise RuntimeError(f"run failed (exit {proc.returncode}):\n{''.join(log[-30:])}")
        spans = [json.loads(line) for line in open(timeline) if line.strip()]
        first = min(s["start"] for s in spans if s["kind"] == "generate")
    return {"to_run_start": run_start - t0, "to_first_token": first, "total": run_start - t0 + first, "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--checkout", action="append", default=None,
                        help="a tree to measure (repeatable: the trees alternate run by run); default this one")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("overrides", nargs="*", help="key=value overrides after the short run's")
    args = parser.parse_args()
    trees = [os.path.abspath(c) for c in (args.checkout or [REPO])]
    results: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for i in range(args.repeat):
        for tree in trees:
            r = measure(tree, args.overrides, args.python, args.timeout)
            results[tree].append(r)
            print(f"{tree} run {i + 1}: " + ", ".join(f"{k}={v:.1f}s" for k, v in r.items()), flush=True)
    print("\n| tree | runs | to_run_start | to_first_token | total (median) | wall |\n|---|---|---|---|---|---|")
    for tree, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| {tree} | {len(rs)} | {med['to_run_start']:.1f} | {med['to_first_token']:.1f} | {med['total']:.1f} | "
              f"{med['wall']:.1f} |")


if __name__ == "__main__":
    main()
