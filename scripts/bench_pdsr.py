#!/usr/bin/env python
"""P-DSR in the real Rollouter: rollout wall time with and without it, at equal samples.

Every mode runs the SAME prompts with the SAME per-response target lengths through the
real Rollouter and native-engine replicas (Ray actors), so the work is identical and only
the scheduling differs. Lengths are controlled: responses run with `ignore_eos` and stop at
a target drawn from the simulator's long-tail generator (verl_async.sim.workload, preset
`longtail`: per-prompt log-normal means, per-response log-normal spread; scaled by
--median-len / --max-response-length), via verl_async.rollout.scripted.TargetLengthEngine
(a capped P-DSR request still stops at its cap, so the breaker fires exactly as it would).

Modes (--modes):
  plain         every response on the least loaded replica; max_num_seqs on every replica
  plain-wide    the same with fast_max_num_seqs on every replica (control: the concurrency
                P-DSR's fast replicas get, without P-DSR)
  pdsr          probe -> rank -> offload -> cap -> breaker, moved responses CONTINUE
  pdsr-restart  the same, moved responses RESTART (regenerated tokens counted)

By default this is rollout only (no trainer: the staleness budget never binds). With
--required > 0 a trainer stand-in takes `required` groups per step, sleeps
--train-step-s and syncs every --trigger steps (a version bump, no weight transfer) under
the staleness budget (--staleness), with partial rollout.

KV memory: the native engine reserves max_model_len tokens per slot, so a fast replica's
larger max_num_seqs costs proportionally more KV memory; the table reports the KV slots
each mode allocates (see bench/RESULTS.md "P-DSR in the Rollouter").

CPU (small; the dev VM has 2 shared cores):
    python scripts/bench_pdsr.py --device cpu --out bench/pdsr_cpu.json
GPU (one GPU, 4 replicas sharing it; or --gpus-per-replica 1 on a multi-GPU box):
    python scripts/bench_pdsr.py --device cuda --model qwen2.5-0.5b-random --replicas 4 \\
        --heavy-replicas 2 --gpus-per-replica 0.25 --prompts 256 --n 8 --median-len 600 \\
        --max-response-length 4096 --prompt-length 256 --max-num-seqs 32 --fast-max-num-seqs 64 \\
        --batch-size 32 --out bench/pdsr_cuda.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_async.rollout.engine import GenerateRequest, SamplingParams  # noqa: E402
from verl_async.rollout.pdsr_policy import (  # noqa: E402
    heavy_indices,
    max_inflight_groups,
    replica_max_num_seqs,
    scheduling_metrics,
)  # noqa: E402
from verl_async.rollout.rollouter import PromptTask, Rollouter  # noqa: E402
from verl_async.rollout.scheduling import policy_class  # noqa: E402
from verl_async.rollout.scripted import TargetLengthEngine  # noqa: E402
from verl_async.staleness import StalenessBudget, max_required_samples  # noqa: E402
from verl_async.sim.workload import PRESETS, length_stats, synthetic_groups  # noqa: E402

MODES = ("plain", "plain-wide", "pdsr", "pdsr-restart")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"))
    p.add_argument("--model", default="tiny", help="tiny | qwen2.5-0.5b-random | a local HF folder")
    p.add_argument("--modes", default="plain,plain-wide,pdsr,pdsr-restart")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--heavy-replicas", type=int, default=1)
    p.add_argument("--gpus-per-replica", type=float, default=1.0, help="cuda: <1 puts several replicas on one GPU")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--preset", default="longtail", choices=sorted(PRESETS))
    p.add_argument("--median-len", type=float, default=40.0)
    p.add_argument("--max-response-length", type=int, default=256)
    p.add_argument("--prompt-length", type=int, default=16, help="prompt tokens (random ids)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--fast-max-num-seqs", type=int, default=16)
    p.add_argument("--offload-ratio", type=float, default=0.2)
    p.add_argument("--cap-factor", type=float, default=1.5)
    p.add_argument("--cap-mode", default="l_cut", choices=("l_cut", "probe"))
    p.add_argument("--batch-size", type=int, default=12, help="P-DSR batch (prompts per probe barrier)")
    p.add_argument("--batch-timeout-s", type=float, default=5.0)
    p.add_argument("--required", type=int, default=0, help="> 0: trainer stand-in taking this many groups per step")
    p.add_argument("--trigger", type=int, default=1)
    p.add_argument("--staleness", type=float, default=0.5)
    p.add_argument("--train-step-s", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=1, help="runs per mode; the median run is reported")
    p.add_argument("--warmup-runs", type=int, default=None, help="untimed runs per mode first (default 0 on cpu, 1 else)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=int, default=None, help="Ray num_cpus (default: os.cpu_count())")
    p.add_argument("--out", default=None, help="JSON results path")
    p.add_argument("--run-dir", default=None, help="write <run-dir>/<mode>/rollout/lengths.jsonl + timeline.jsonl (first repeat)")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {MODES}")
    if args.warmup_runs is None:
        args.warmup_runs = 0 if args.device == "cpu" else 1
    heavy_indices(args.replicas, args.heavy_replicas)  # validates: P-DSR needs a fast and a heavy replica
    return args


# ---------------------------------------------------------------------- model and replicas
def model_dir(args) -> str:
    if args.model == "tiny":
        from verl_async.models.tiny import build_tiny_model_dir

        need = args.prompt_length + args.max_response_length
        return build_tiny_model_dir(os.path.join(tempfile.gettempdir(), f"verl_async_bench_pdsr_tiny_{need}"),
                                    max_position_embeddings=max(1024, need))
    if args.model == "qwen2.5-0.5b-random":
        import torch
        from transformers import AutoModelForCausalLM, Qwen2Config

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_engine import QWEN25_05B

        path = os.path.join(tempfile.gettempdir(), "verl_async_bench_qwen05b_random")
        if not os.path.exists(os.path.join(path, "config.json")):
            config = Qwen2Config(**QWEN25_05B, eos_token_id=151645, pad_token_id=151643, bos_token_id=None)
            torch.manual_seed(args.seed)
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
        return path
    return args.model


def start(args, path: str, capacities: list[int]) -> list[Any]:
    """One replica actor per capacity entry (its max_num_seqs), the pipeline's replica class."""
    import ray

    from verl_async.rollout.replica import EngineReplica, RemoteEngine, ReplicaSpec, replica_actor_options

    cfg = {"name": "native", "max_num_seqs": max(capacities), "prompt_length": args.prompt_length,
           "response_length": args.max_response_length, "seed": args.seed, "dtype": "bfloat16"}
    options = replica_actor_options(args.device, 1)
    if args.device == "cuda":
        options["num_gpus"] = args.gpus_per_replica
    actor = ray.remote(EngineReplica)
    handles = [actor.options(max_concurrency=1000, **options).remote(
        ReplicaSpec(cfg, path, args.device), index=i, engine_overrides={"max_num_seqs": c}) for i, c in enumerate(capacities)]
    ray.get([h.version.remote() for h in handles], timeout=900)
    return [RemoteEngine(h, i) for i, h in enumerate(handles)]


def stop(engines) -> None:
    import ray

    for e in engines:
        ray.kill(e.handle)


# ---------------------------------------------------------------------- one mode
class Source:
    def __init__(self, items: list[PromptTask]) -> None:
        self.items = list(items)

    def next(self) -> Optional[PromptTask]:
        return self.items.pop(0) if self.items else None

    def push_front(self, items) -> None:
        self.items[:0] = list(items)

    def state_dict(self) -> dict:
        return {}


class Sink:
    def __init__(self) -> None:
        self.groups: list = []
        self.cond = asyncio.Condition()
        self.last_put = 0.0

    async def put(self, sample) -> None:
        async with self.cond:
            self.groups.append(sample)
            self.last_put = time.monotonic()
            self.cond.notify_all()

    async def take(self, count: int, rollout: asyncio.Task) -> int:
        """Wait until `count` groups arrived (or the rollout ended); the number that did."""
        while True:
            async with self.cond:
                try:
                    await asyncio.wait_for(self.cond.wait_for(lambda: len(self.groups) >= count), 0.5)
                    return len(self.groups)
                except asyncio.TimeoutError:
                    pass
            if rollout.done():
                return len(self.groups)

    async def size(self) -> int:
        return 0  # the stand-in trainer takes groups as they come (nothing waits in a queue)


async def warm(engines, prompt: list[int], args) -> None:
    """First requests compile / capture / allocate; keep them out of the timing."""
    sp = SamplingParams(temperature=1.0, max_tokens=min(32, args.max_response_length), ignore_eos=True, seed=0)
    await asyncio.gather(*(e.generate(GenerateRequest(f"warm{i}-{j}", prompt, sp))
                           for i, e in enumerate(engines) for j in range(4)))


async def run_mode(args, mode: str, engines, tasks: list[PromptTask], targets: dict, capacities: list[int],
                   log_dir: Optional[str] = None) -> dict:
    scripted = [TargetLengthEngine(e, lambda uid, i: targets[uid][i]) for e in engines]
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_response_length, ignore_eos=True, seed=args.seed)
    limit = (max_required_samples(args.required, args.trigger, args.staleness) if args.required > 0
             else len(tasks))
    kwargs: dict[str, Any] = {}
    if mode.startswith("pdsr"):
        kwargs = {"offload_ratio": args.offload_ratio, "cap_factor": args.cap_factor, "cap_mode": args.cap_mode,
                  "heavy_replicas": args.heavy_replicas, "restart": mode == "pdsr-restart",
                  "batch_size": args.batch_size, "batch_timeout_s": args.batch_timeout_s}
    sink = Sink()
    logs: dict[str, Any] = {}
    if log_dir:  # the run-dir layout (docs/log_formats.md), so the simulator can replay / calibrate on it
        import shutil

        from verl_async.utils.timeline import Timeline

        shutil.rmtree(log_dir, ignore_errors=True)
        os.makedirs(log_dir)
        logs = {"lengths_log": os.path.join(log_dir, "rollout", "lengths.jsonl"),
                "timeline": Timeline(os.path.join(log_dir, "timeline.jsonl"), time.time())}
    ro = Rollouter(
        engines=scripted, prompts=Source(tasks), scorer=_score, sink=sink, n=args.n, sampling=sampling,
        budget=StalenessBudget(limit), partial_rollout=True,
        max_inflight_groups=max_inflight_groups(capacities, args.n, "pdsr" if kwargs else "plain", kwargs),
        scheduling=policy_class("pdsr" if mode.startswith("pdsr") else "plain"), scheduling_kwargs=kwargs,
        engine_capacity=capacities, **logs,
    )
    t0 = time.monotonic()
    rollout = asyncio.create_task(ro.run())
    syncs = 0
    if args.required > 0:
        version, taken = 0, 0
        while taken < len(tasks):
            got = await sink.take(min(taken + args.required, len(tasks)), rollout)
            if got <= taken:
                break
            taken = got
            await asyncio.sleep(args.train_step_s)
            if (taken // args.required) % args.trigger == 0 and taken < len(tasks):
                await ro.pause_for_sync()
                await ro.load_weights([], version + 1)
                version += 1
                syncs += 1
                await ro.resume_after_sync(version)
    counters = await rollout
    wall = sink.last_put - t0
    metrics = scheduling_metrics(ro, wall)
    lengths = [len(r) for g in sink.groups for r in g.responses]
    assert len(sink.groups) == len(tasks) and all(len(g.responses) == args.n for g in sink.groups)
    expect = {uid: list(v) for uid, v in targets.items()}
    assert all([len(r) for r in g.responses] == expect[g.uid] for g in sink.groups), "lengths differ from targets"
    out = {
        "mode": mode,
        "wall_s": wall,
        "groups": len(sink.groups),
        "responses": len(lengths),
        "tokens": int(sum(lengths)),
        "generated_tokens": counters.generated_tokens,
        "tokens_per_s": sum(lengths) / wall,
        "syncs": syncs,
        "kv_slots": int(sum(capacities)),
        "capacities": capacities,
        "replica_busy": [metrics[f"rollout/replica{i}/busy_ratio"] for i in range(len(engines))],
        "group_latency_p50": metrics.get("rollout/group_latency_p50"),
        "group_latency_p95": metrics.get("rollout/group_latency_p95"),
        "group_latency_p99": metrics.get("rollout/group_latency_p99"),
    }
    out.update({k: v for k, v in metrics.items() if k.startswith("pdsr/")})
    return out


async def _score(item, responses):
    return [(0.0, {}) for _ in responses]


# ---------------------------------------------------------------------- main
def workload(args):
    spec = replace(PRESETS[args.preset], max_response_length=args.max_response_length,
                   median_len=args.median_len)
    groups = synthetic_groups(args.prompts, args.n, spec, seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    tasks = [PromptTask(g.uid, i, 0, [int(x) for x in rng.integers(3, 200, args.prompt_length)])
             for i, g in enumerate(groups)]
    return groups, tasks, {g.uid: list(g.lengths) for g in groups}


def capacities_for(args, mode: str) -> list[int]:
    if mode == "plain":
        return [args.max_num_seqs] * args.replicas
    if mode == "plain-wide":
        return [args.fast_max_num_seqs] * args.replicas
    return replica_max_num_seqs(args.replicas, args.max_num_seqs, args.heavy_replicas, args.fast_max_num_seqs)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import ray

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    ray.init(num_cpus=args.num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})
    groups, tasks, targets = workload(args)
    stats = length_stats(groups, args.batch_size, args.offload_ratio, args.cap_factor,
                         threshold=int(args.median_len), max_response_length=args.max_response_length,
                         cap_mode=args.cap_mode)
    path = model_dir(args)
    results = []
    by_caps: dict[tuple, list] = {}
    try:
        for mode in args.modes:
            caps = capacities_for(args, mode)
            if tuple(caps) not in by_caps:
                for old in by_caps.values():
                    stop(old)
                by_caps = {tuple(caps): start(args, path, caps)}
                asyncio.run(warm(by_caps[tuple(caps)], tasks[0].prompt_ids, args))
            for _ in range(args.warmup_runs):  # untimed: lazy CUDA-graph captures, allocator growth
                asyncio.run(run_mode(args, mode, by_caps[tuple(caps)], tasks, targets, caps))
            runs = [asyncio.run(run_mode(args, mode, by_caps[tuple(caps)], tasks, targets, caps,
                                         os.path.join(args.run_dir, mode) if args.run_dir and k == 0 else None))
                    for k in range(args.repeats)]
            r = sorted(runs, key=lambda x: x["wall_s"])[len(runs) // 2]  # the median run
            r["wall_s_runs"] = [x["wall_s"] for x in runs]
            results.append(r)
            print(f"{mode}: {' '.join(f'{x:.2f}' for x in r['wall_s_runs'])} s", flush=True)
    finally:
        for old in by_caps.values():
            stop(old)
        ray.shutdown()
    base = next((r["wall_s"] for r in results if r["mode"] == "plain"), None)
    for r in results:
        r["saving_vs_plain"] = None if base is None else 1.0 - r["wall_s"] / base
    report = {
        "command": "python scripts/bench_pdsr.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": f"{args.device} ({platform.machine()}, {os.cpu_count()} cores)",
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "workload": stats,
        "results": results,
    }
    print(table(results))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


def table(results: list[dict]) -> str:
    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    def num(v, fmt=".2f"):
        return "-" if v is None else format(v, fmt)

    head = ("| mode | wall s | vs plain | tokens/s | KV slots | busy per replica | breaker (resp / prompt) "
            "| offloaded | precision | regen tokens | lat p50 / p95 / p99 s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        pdsr_row = "pdsr/breaker_rate" in r
        lines.append(
            f"| {r['mode']} | {r['wall_s']:.2f} | {pct(r['saving_vs_plain'])} | {r['tokens_per_s']:.0f} "
            f"| {r['kv_slots']} | {' '.join(f'{b:.2f}' for b in r['replica_busy'])} "
            f"| {pct(r.get('pdsr/breaker_rate')) + ' / ' + pct(r.get('pdsr/breaker_prompt_rate')) if pdsr_row else '-'} "
            f"| {int(r['pdsr/offload_count']) if pdsr_row else '-'} | {num(r.get('pdsr/topk_precision'))} "
            f"| {int(r.get('pdsr/regenerated_tokens', 0))} "
            f"| {num(r['group_latency_p50'])} / {num(r['group_latency_p95'])} / {num(r['group_latency_p99'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
