"""Fully async vs synchronous colocated RL, same workload, same GPUs, same trained samples (not a test).

    python scripts/bench_async.py --device cuda --gpus 4 --engine vllm --out $OUT/bench_async_4gpu.json
    python scripts/bench_async.py --device cpu --tiny --gpus 2 --configs sync,s0.5_p1   # smoke check of the script

Every configuration runs the real product, `verl_async.pipeline.run(cfg)` (Ray, Rollouter,
MessageQueue, FSDP2 Trainer, parameter sync), each in its own Ray session:

* `sync` - synchronous on-policy, COLOCATED: the engine replicas and the trainer ranks share
  all `--gpus` GPUs (one replica + one trainer rank per GPU; `rollout.colocate=true`) with
  `staleness_threshold=0`, `trigger_parameter_sync_step=1`,
  `partial_rollout=false`: all GPUs generate one batch, then all GPUs train on it, then the
  weights move (`--colocated-transport`, default `auto`: CUDA IPC from each trainer rank to the
  native replica on its GPU; the object store with vLLM or on CPU; NCCL cannot join two
  processes of one GPU); repeat. This is verl's default (hybrid) trainer's schedule with the same
  engine and trainer code. Its KV memory is smaller (the trainer lives beside it). The table also
  gives `sync-nosync`: its wall time minus every second spent in parameter sync - the speedups
  are computed against that (the baseline's best).
* `sS_pP` - fully async, split GPUs: `--gpus/2` rollout GPUs, `--gpus/2` trainer GPUs,
  `staleness_threshold=S`, `partial_rollout=P`, weights over NCCL (gloo on CPU).

Workload (stated, synthetic): a random-weight model of Qwen2.5-0.5B's shape (no hub; `--tiny`:
a tiny Qwen2), prompts from the built-in task, and long-tail response lengths forced per
response: each prompt draws a mean length from a log-normal (`--cv-between`), each of its
`n` responses a length around it (`--cv-within`), capped at `--max-response-length`;
`rollout.ignore_eos=true` plus the rows' `extra_info.target_lengths` (read by
`Rollouter.generate_one`) make every response exactly that long (finish_reason "length").
All configurations train the same `--steps x --prompts-per-step` prompts.

Measured on the run's own timeline (`timeline.jsonl`), over the window from the first
generated token to the end of the last training step (start-up excluded):
wall time, trained tokens/s (prompt + response tokens of every trained sample / window),
rollout busy (union of generation spans) and trainer busy (train + log-prob spans), their
idle ratios, pipeline efficiency = max(gen busy, train busy) / wall, `timing_s/param_sync`
(mean over syncs, from TensorBoard), peak GPU memory (max over GPUs of nvidia-smi's used
memory, sampled every 0.5 s: engines pre-allocate, so this is the honest figure), and the
trainer's own `perf/max_memory_allocated_gb`. Prints a table; writes JSON after every run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = ("sync", "s0_p1", "s0.5_p1", "s1_p1", "s0_p0", "s0.5_p0", "s1_p0")  # the default grid
# sync | sS_pP[_tT] (split GPUs) | cS_pP[_tT] (colocated on every GPU, fully async): staleness S, partial rollout P,
# trigger_parameter_sync_step T (default --trigger)
CONFIG_RE = re.compile(r"^(?P<layout>[sc])(?P<staleness>\d+(?:\.\d+)?)_p(?P<partial>[01])(?:_t(?P<trigger>\d+))?$")
# Qwen2.5 shapes as the hub's config.json files state them (random weights, built here)
SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
               intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}
SHAPE_COMMON = dict(max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)


def parse_config(name: str, default_trigger: int) -> dict[str, Any]:
    """`sync` or `sS_pP[_tT]` / `cS_pP[_tT]` -> layout, staleness, partial rollout, trigger."""
    if name == "sync":
        return {"layout": "colocated", "staleness": 0.0, "partial": False, "trigger": 1}
    m = CONFIG_RE.match(name)
    if m is None:
        raise ValueError(f"config {name!r}: sync, sS_pP[_tT] (split) or cS_pP[_tT] (colocated async)")
    return {"layout": "split" if m["layout"] == "s" else "colocated", "staleness": float(m["staleness"]),
            "partial": m["partial"] == "1", "trigger": int(m["trigger"] or default_trigger)}


# ------------------------------------------------------------------------------------- workload
def lognormal_lengths(rng: random.Random, mean: float, cv: float, count: int, cap: int) -> list[int]:
    """`count` draws of a log-normal with the given mean and coefficient of variation, in [1, cap]."""
    sigma2 = math.log(1.0 + cv * cv)
    mu = math.log(max(mean, 1.0)) - sigma2 / 2
    return [max(1, min(cap, int(round(rng.lognormvariate(mu, math.sqrt(sigma2)))))) for _ in range(count)]


def write_workload(path: str, prompts: int, n: int, *, mean: float, cv_between: float, cv_within: float, cap: int,
                   seed: int) -> dict[str, float]:
    """Built-in task prompts with per-response target lengths; returns the realised length statistics."""
    from verl_async.data import builtin
    from verl_async.data.files import write_rows

    rng = random.Random(seed)
    rows = builtin.generate_rows("bench", prompts, seed)
    means = lognormal_lengths(rng, mean, cv_between, prompts, cap)
    lengths: list[int] = []
    cvs = []
    for row, m in zip(rows, means):
        targets = lognormal_lengths(rng, m, cv_within, n, cap)
        row["extra_info"]["target_lengths"] = targets
        lengths += targets
        mu = sum(targets) / n
        cvs.append((sum((t - mu) ** 2 for t in targets) / n) ** 0.5 / mu)
    write_rows(rows, path)
    mu = sum(lengths) / len(lengths)
    return {"mean": mu, "max": max(lengths), "cv_all": (sum((x - mu) ** 2 for x in lengths) / len(lengths)) ** 0.5 / mu,
            "cv_within_mean": sum(cvs) / len(cvs), "capped_fraction": sum(x == cap for x in lengths) / len(lengths),
            "total_response_tokens": sum(lengths)}


def build_model(path: str, shape: str) -> str:
    """The random-weight model folder of `shape` (tiny | a SHAPES key), built in a child process (the driver keeps
    no GPU memory)."""
    spec = "TINY" if shape == "tiny" else json.dumps({**SHAPES[shape], **SHAPE_COMMON})
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import bench_train as b; "
            "b.build_model_dir(sys.argv[2], b.TINY if sys.argv[3] == 'TINY' else json.loads(sys.argv[3]))")
    subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "scripts"), path, spec], check=True)
    return path


# ------------------------------------------------------------------------------------- configs
def overrides_for(name: str, args: argparse.Namespace, model: str, data: str, run_dir: str) -> list[str]:
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    spec = parse_config(name, args.trigger)
    staleness, partial, trigger = spec["staleness"], spec["partial"], spec["trigger"]
    colocated = spec["layout"] == "colocated"
    split = args.train_gpus or max(1, args.gpus // 2)
    train_gpus = args.gpus if colocated else split
    rollout_gpus = args.gpus if colocated else args.gpus - split
    if colocated:  # auto: cuda_ipc for colocated native replicas on CUDA (config/derived.py), else object_store
        transport = args.colocated_transport
    else:
        transport = "gloo" if args.device == "cpu" else "nccl"
    mem = args.gpu_memory_sync if colocated else args.gpu_memory
    out = [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data}", "data.val_files=null", f"data.max_prompt_length={args.max_prompt_length}",
        f"data.max_response_length={args.max_response_length}", "data.shuffle=false",
        f"trainer.device={args.device}", f"trainer.n_gpus_per_node={train_gpus}",
        f"rollout.n_gpus_per_node={rollout_gpus}", f"rollout.total_rollout_steps={args.steps * args.prompts_per_step}",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        "trainer.logger=[tensorboard]", f"trainer.default_local_dir={run_dir}", f"trainer.experiment_name={name}",
        f"{a}.ppo_mini_batch_size={args.prompts_per_step}", f"{a}.ppo_max_token_len_per_gpu={args.max_tokens_per_gpu}",
        f"{a}.use_dynamic_bsz=true", f"{a}.optim.lr=1e-6",
        f"{r}.name={args.engine}", f"{r}.n={args.n}", f"{r}.temperature=1.0", f"{r}.ignore_eos=true",
        f"{r}.max_num_seqs={args.max_num_seqs}", f"{r}.gpu_memory_utilization={mem}",
        f"{r}.enforce_eager={'true' if args.enforce_eager else 'false'}",
        f"{r}.max_num_batched_tokens={args.max_num_batched_tokens}",
        f"async_training.staleness_threshold={staleness}", f"async_training.partial_rollout={str(partial).lower()}",
        f"async_training.trigger_parameter_sync_step={trigger}",
        f"async_training.sync_transport={transport}", "async_training.require_batches=1",
        f"rollout.colocate={'true' if colocated else 'false'}",
    ]
    if args.engine == "native" and args.device == "cuda":
        # the native engine sizes its KV up front (gpu_memory_utilization is vLLM's): one slot per sequence
        out.append(f"{r}.kv_cache_tokens={args.max_num_seqs * (args.max_prompt_length + args.max_response_length)}")
    return out + list(args.extra)


def compose(overrides: list[str], engine: str, device: str, max_num_seqs: int = 256,
            config_name: str = "fully_async_ppo_trainer"):
    from omegaconf import OmegaConf, open_dict

    from verl_async.config import validate
    from verl_async.config.cli import compose as hydra_compose

    cfg = hydra_compose(config_name, overrides=overrides)
    if engine == "vllm":
        # no torch.compile (start-up in seconds); full CUDA graphs for decode steps at a few batch sizes
        sizes = [1 << k for k in range(0, 12) if (1 << k) <= max(1, max_num_seqs)]
        with open_dict(cfg):
            OmegaConf.update(cfg, "actor_rollout_ref.rollout.engine_kwargs.vllm",
                             {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                                     "cudagraph_capture_sizes": sizes}}, merge=True)
    return validate(cfg)


# ------------------------------------------------------------------------------------- measuring
class GpuMemorySampler:
    """Max used memory per GPU (nvidia-smi), sampled in a thread; {} on machines without it."""

    def __init__(self, period: float = 0.5) -> None:
        self.period = period
        self.peak: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict[int, float]:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
        vals = {}
        for line in out.stdout.strip().splitlines():
            i, used = line.split(",")
            vals[int(i)] = float(used) / 1024.0
        return vals

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for i, v in self._sample().items():
                    self.peak[i] = max(self.peak.get(i, 0.0), v)
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            self._stop.wait(self.period)

    def __enter__(self) -> "GpuMemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def tensorboard_means(run_dir: str, keys: tuple[str, ...]) -> dict[str, float]:
    from verl_async.utils.tb_read import read_scalars

    scalars = read_scalars(run_dir)
    out = {}
    for key in keys:
        if scalars.get(key):
            values = [p.value for p in scalars[key]]
            out[key] = {"mean": sum(values) / len(values), "max": max(values), "count": len(values)}
    return out


def wait_for_free_gpus(limit_gib: float = 2.0, timeout: float = 60.0) -> None:
    """After a run, until every GPU is (nearly) empty again: the next run's engines size themselves from free memory."""
    sampler = GpuMemorySampler()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            used = sampler._sample()
        except (OSError, ValueError, subprocess.SubprocessError):
            return
        if not used or max(used.values()) < limit_gib:
            return
        time.sleep(1.0)
    print(f"warning: GPUs still hold memory after {timeout:.0f}s: {used}", flush=True)


# ------------------------------------------------------------------------------------- one run
def run_one(name: str, args: argparse.Namespace, model: str, data: str) -> dict[str, Any]:
    from verl_async.pipeline import run
    from verl_async.utils.timeline import timeline_metrics

    run_dir = os.path.join(args.work_dir, name)
    cfg = compose(overrides_for(name, args, model, data, run_dir), args.engine, args.device, args.max_num_seqs,
                  args.config_name)
    t0 = time.perf_counter()
    with GpuMemorySampler() if args.device == "cuda" else contextlib.nullcontext() as mem:
        summary = run(cfg)
    total = time.perf_counter() - t0
    out: dict[str, Any] = {"config": name, "run_dir": run_dir, "total_s_with_startup": total}
    out.update(timeline_metrics(run_dir))
    tb = tensorboard_means(run_dir, ("timing_s/param_sync", "timing_s/sync_total", "perf/max_memory_allocated_gb",
                                     "fully_async/staleness/mean", "fully_async/staleness/max",
                                     "fully_async/partial_responses", "response_length/mean", "perf/mfu/actor",
                                     "perf/step_tokens_per_s", "timing_s/sync_gather", "timing_s/sync_send",
                                     "timing_s/sync_receive_load", "sync/bytes"))
    out["tensorboard"] = tb
    out["param_sync_s"] = tb.get("timing_s/param_sync", {}).get("mean", float("nan"))
    out["trainer_peak_mem_gb"] = tb.get("perf/max_memory_allocated_gb", {}).get("max", float("nan"))
    out["gpu_peak_mem_gb"] = max(mem.peak.values()) if args.device == "cuda" and mem.peak else float("nan")
    out["gpu_peak_mem_by_gpu"] = dict(mem.peak) if args.device == "cuda" else {}
    out["steps"] = summary.get("trainer/steps")
    out["engine_profile"] = summary.get("rollout/engine_profile", {})  # prefill vs decode seconds, summed over replicas
    out["wall_minus_sync_s"] = out["wall_s"] - out["sync_s"]
    return out


def table(results: list[dict], base: Optional[dict]) -> str:
    head = ("config", "wall_s", "tok/s", "speedup", "gen_idle", "train_idle", "pipe_eff", "param_sync_s",
            "gpu_peak_GB", "stale_mean", "running_req", "hold_budget_s", "hold_sync_s", "startup_s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref = None
    if base is not None:
        ref = base["trained_tokens"] / max(base["wall_minus_sync_s"], 1e-9)
    rows = []
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error'][:80]} |")
            continue
        rows.append((r["config"], r["wall_s"], r["trained_tokens_per_s"], r))
        if r["config"] == "sync":
            rows.append(("sync-nosync", r["wall_minus_sync_s"], r["trained_tokens"] / max(r["wall_minus_sync_s"], 1e-9),
                         r))
    for name, wall, tps, r in rows:
        speed = f"{tps / ref:.2f}x" if ref else "-"
        stale = r["tensorboard"].get("fully_async/staleness/mean", {}).get("mean", float("nan"))
        lines.append(f"| {name} | {wall:.1f} | {tps:.0f} | {speed} | {r['rollout_idle_ratio']:.2f} | "
                     f"{r['trainer_idle_ratio']:.2f} | {r['pipeline_efficiency']:.2f} | {r['param_sync_s']:.3f} | "
                     f"{r['gpu_peak_mem_gb']:.1f} | {stale:.2f} | {r.get('mean_running_requests', float('nan')):.0f} | "
                     f"{r.get('admission_hold_budget_s', float('nan')):.1f} | "
                     f"{r.get('admission_hold_sync_s', float('nan')):.1f} | {r.get('startup_s', float('nan')):.1f} |")
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gpus", type=int, default=4, help="GPUs in total (split half/half for the async runs)")
    p.add_argument("--train-gpus", type=int, default=None,
                   help="trainer GPUs of the async runs (default half; the rest generate), e.g. 1 of 4")
    p.add_argument("--engine", choices=("vllm", "native"), default="vllm")
    p.add_argument("--tiny", action="store_true", help="tiny model and workload (CPU smoke check)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {CONFIGS}")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default 8; tiny 2)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="ppo_mini_batch_size (default 16; tiny 2)")
    p.add_argument("--n", type=int, default=None, help="responses per prompt (default 8; tiny 2)")
    p.add_argument("--max-response-length", type=int, default=None, help="default 2048; tiny 24")
    p.add_argument("--max-prompt-length", type=int, default=None, help="default 128; tiny 64")
    p.add_argument("--length-mean", type=float, default=None, help="mean target response length (default 512; tiny 8)")
    p.add_argument("--cv-between", type=float, default=0.8, help="CV of the per-prompt mean lengths")
    p.add_argument("--cv-within", type=float, default=0.4, help="CV of the lengths within a prompt's group")
    p.add_argument("--trigger", type=int, default=1, help="trigger_parameter_sync_step of the async runs")
    p.add_argument("--max-num-seqs", type=int, default=None, help="per replica (default 256; tiny 4)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-tokens-per-gpu", type=int, default=None, help="ppo_max_token_len_per_gpu (default 8192)")
    p.add_argument("--gpu-memory", type=float, default=0.6, help="vLLM gpu_memory_utilization, split GPUs")
    p.add_argument("--gpu-memory-sync", type=float, default=0.35, help="vLLM gpu_memory_utilization, colocated")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--colocated-transport", choices=("auto", "cuda_ipc", "object_store"), default="auto",
                   help="async_training.sync_transport of the colocated runs (sync, cS_pP): auto picks cuda_ipc for "
                        "native replicas on CUDA (issue 37: 2 ranks + 2 replicas of the 3B shape took 25.0 s per "
                        "sync through object_store)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="Qwen2.5 shape of the random model")
    p.add_argument("--config-name", default="fully_async_ppo_trainer",
                   help="the recipe config every run composes (fully_async_ppo_megatron_trainer: the Megatron trainer)")
    p.add_argument("--extra", action="append", default=[], help="one more key=value override for every run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=None, help="run folders (default: <out dir>/bench_async_runs)")
    p.add_argument("--out", default="bench/bench_async.json")
    return p


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The sizes left unset: the tiny smoke check's or the benchmark's."""
    defaults = dict(steps=(2, 8), prompts_per_step=(2, 16), n=(2, 8), max_response_length=(24, 2048),
                    max_prompt_length=(64, 128), length_mean=(8, 512), max_num_seqs=(4, 256),
                    max_tokens_per_gpu=(4096, 8192))
    for key, (small, big) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, small if args.tiny else big)
    if args.device == "cpu":
        args.engine = "native"
    return args


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, list[str]]:
    """The arguments with their size defaults filled in, and the config names (also read by
    scripts/device/verl_bench2.py, whose two-GPU runs take this workload and these settings)."""
    p = make_parser()
    args = fill_defaults(p.parse_args(argv))
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c != "sync" and CONFIG_RE.match(c) is None]
    if bad:
        p.error(f"unknown --configs {bad}: sync, sS_pP[_tT] (split) or cS_pP[_tT] (colocated async), e.g. {CONFIGS}")
    if args.train_gpus is not None and not 1 <= args.train_gpus < args.gpus:
        p.error(f"--train-gpus {args.train_gpus}: the async runs need 1..{args.gpus - 1} of the --gpus {args.gpus}")
    return args, configs


def main(argv: Optional[list[str]] = None) -> int:
    args, configs = parse_args(argv)
    tiny = args.tiny
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    args.work_dir = args.work_dir or os.path.join(out_dir, "bench_async_runs")
    os.makedirs(args.work_dir, exist_ok=True)
    cache = os.environ.get("VERL_ASYNC_CACHE") or os.path.expanduser("~/.cache/verl_async")
    model = build_model(os.path.join(cache, "bench_models", "tiny" if tiny else f"qwen2.5-{args.shape}-shape"),
                        "tiny" if tiny else args.shape)
    data = os.path.join(args.work_dir, "workload.parquet")
    lengths = write_workload(data, args.steps * args.prompts_per_step, args.n, mean=args.length_mean,
                             cv_between=args.cv_between, cv_within=args.cv_within, cap=args.max_response_length,
                             seed=args.seed)
    record: dict[str, Any] = {"args": vars(args), "workload": lengths, "device": _device_name(args.device),
                              "results": []}
    print(f"workload: {json.dumps(lengths)}", flush=True)
    for name in configs:
        print(f"=== {name} ===", flush=True)
        try:
            res = run_one(name, args, model, data)
        except Exception as exc:  # noqa: BLE001 - one failed config must not lose the others
            traceback.print_exc()
            res = {"config": name, "error": f"{type(exc).__name__}: {exc}"}
        record["results"].append(res)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1, default=str)
        if args.device == "cuda":
            wait_for_free_gpus()
    base = next((r for r in record["results"] if r["config"] == "sync" and "error" not in r), None)
    text = table(record["results"], base)
    record["table"] = text
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1, default=str)
    print(text, flush=True)
    return 0 if all("error" not in r for r in record["results"]) else 1


def _device_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        names = out.stdout.strip().splitlines()
        return f"{len(names)} x {names[0]}" if names else "cuda"
    except (OSError, subprocess.SubprocessError):
        return "cuda"


if __name__ == "__main__":
    sys.exit(main())
