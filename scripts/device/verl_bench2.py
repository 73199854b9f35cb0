"""The two-GPU throughput workload of scripts/device/verl_compare.sh (issue 37 item 3), from scripts/bench_async.py.

    python scripts/device/verl_bench2.py setup DIR [--steps N] [--shape 1.5b]
        DIR/model (random weights of the Qwen2.5 shape, bench_async.build_model) and DIR/train.parquet
        (bench_async.write_workload: steps x 16 prompts, 8 forced long-tail lengths each, mean 512, cap 2048)
    python scripts/device/verl_bench2.py ours CONFIG DIR RUN_DIR [--steps N] [--shape 1.5b]
        the `python -m recipe.fully_async_main` overrides of bench_async's CONFIG (sync | sS_pP[_tT] | cS_pP[_tT])
        on that model and workload, one per line

Both sides read the same files, and ours gets exactly bench_async's settings (bench_async.parse_args with
--gpus 2 --engine native), so these runs and bench/RESULTS.md's "Two GPUs" section measure one workload.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import bench_async  # noqa: E402  (scripts/)


def bench_args(steps: int, shape: str, configs: str = "sync") -> argparse.Namespace:
    """bench_async's arguments for two GPUs and the native engine (its defaults otherwise)."""
    args, _ = bench_async.parse_args(["--gpus", "2", "--engine", "native", "--shape", shape, "--steps", str(steps),
                                      "--configs", configs])
    return args


def setup(folder: str, args: argparse.Namespace) -> dict:
    model = bench_async.build_model(os.path.join(folder, "model"), args.shape)
    stats = bench_async.write_workload(os.path.join(folder, "train.parquet"), args.steps * args.prompts_per_step,
                                       args.n, mean=args.length_mean, cv_between=args.cv_between,
                                       cv_within=args.cv_within, cap=args.max_response_length, seed=args.seed)
    return {"model": model, "shape": args.shape, "prompts": args.steps * args.prompts_per_step, "n": args.n,
            "max_prompt_length": args.max_prompt_length, **stats}


def ours_overrides(config: str, folder: str, run_dir: str, args: argparse.Namespace) -> list[str]:
    return bench_async.overrides_for(config, args, os.path.join(folder, "model"),
                                     os.path.join(folder, "train.parquet"), run_dir)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="build the model and write the workload")
    s.add_argument("dir")
    o = sub.add_parser("ours", help="print our run's overrides")
    o.add_argument("config")
    o.add_argument("dir")
    o.add_argument("run_dir")
    for q in (s, o):
        q.add_argument("--steps", type=int, default=8, help="trainer steps of 16 prompts (default 8)")
        q.add_argument("--shape", default="1.5b", choices=sorted(bench_async.SHAPES))
    a = p.parse_args(argv)
    if a.cmd == "setup":
        print("workload", json.dumps(setup(a.dir, bench_args(a.steps, a.shape))), flush=True)
    else:
        print("\n".join(ours_overrides(a.config, a.dir, a.run_dir, bench_args(a.steps, a.shape, a.config))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
