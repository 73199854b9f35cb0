"""Collective weight sync on GPUs: bit-exactness and speed for a 0.5B-shaped model (not a test).

    python scripts/check_sync_gpu.py --trainer-gpus 1 --replicas 1                  # 2 GPUs
    python scripts/check_sync_gpu.py --trainer-gpus 2 --replicas 2 --engine vllm    # 4 GPUs
    python scripts/check_sync_gpu.py --device cpu --tiny                            # smoke check (gloo)

What it does, with the product's own classes (FSDPWorkerGroup, EngineReplica actors,
CollectiveSync over NCCL):
1. ceilings, in a child process: device-to-device copy on GPU 0 (bytes read + written per
   second) and the GPU 0 -> GPU 1 copy (bytes per second), the link a broadcast crosses;
2. trainer (FSDP2, `--trainer-gpus` ranks) and `--replicas` engine replicas on the other
   GPUs, all from the same random-weight Qwen2.5-0.5B-shaped model;
3. sync 0 with checksums, one training step (lr 1e-3, so that the bf16 weights move), sync 1
   with checksums: every engine rank must have received, and (native engine) loaded, exactly
   the trainer's bytes for every tensor, and the weights must differ from sync 0's;
4. `--repeats` timed syncs per bucket size (`--bucket-mb`) with and without double buffering:
   `timing_s/param_sync` (median), GB/s = bytes / time, and its ratio to the GPU 0 -> 1 copy.
Target (issue 7): <= 0.1 s for the 0.5B model on one host. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

BANDWIDTH_CODE = r"""
import json, sys, torch
n = int(sys.argv[1]) << 20
out = {}
def timed(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record(); fn(); end.record(); end.synchronize(); times.append(start.elapsed_time(end) / 1e3)
    times.sort(); return times[len(times) // 2]
src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
dst = torch.empty_like(src)
t = timed(lambda: dst.copy_(src))
out["d2d_read_plus_write_GBps"] = 2 * n / t / 1e9
if torch.cuda.device_count() > 1:
    other = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    t = timed(lambda: other.copy_(src))
    out["gpu0_to_gpu1_GBps"] = n / t / 1e9
    out["p2p_access"] = bool(torch.cuda.can_device_access_peer(0, 1))
out["gpu"] = torch.cuda.get_device_name(0)
print("BANDWIDTH " + json.dumps(out))
"""


def measure_bandwidth(mib: int) -> dict[str, Any]:
    res = subprocess.run([sys.executable, "-c", BANDWIDTH_CODE, str(mib)], capture_output=True, text=True, timeout=300)
    for line in res.stdout.splitlines():
        if line.startswith("BANDWIDTH "):
            return json.loads(line[len("BANDWIDTH "):])
    raise RuntimeError(f"bandwidth probe failed: {res.stderr[-2000:]}")


def random_batch(groups: int, n: int, length: int, vocab: int, seed: int):
    """A collate_groups batch of random tokens (and random advantages for one update)."""
    import random

    import torch

    from verl_async.protocol import Response, RolloutSample, collate_groups

    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(16)]
        responses = [Response(token_ids=[rng.randrange(3, vocab) for _ in range(length)], log_probs=[-1.0] * length,
                              versions=[0] * length, finish_reason="length", reward=rng.random()) for _ in range(n)]
        samples.append(RolloutSample(uid=f"g{g}", prompt_ids=prompt, responses=responses))
    batch = collate_groups(samples, pad_token_id=0)
    adv = torch.randn(batch.batch_size[0], 1, generator=torch.Generator().manual_seed(seed))
    batch["advantages"] = (adv * batch["response_mask"]).contiguous()
    return batch


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--trainer-gpus", type=int, default=1)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--engine", choices=("native", "vllm"), default="native")
    p.add_argument("--bucket-mb", default="64,256,1024")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bandwidth-mib", type=int, default=1024)
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--out", default="bench/sync_gpu.json")
    args = p.parse_args(argv)

    import ray

    from bench_async import build_model, compose
    from verl_async.rollout.replica import SyncTarget
    from verl_async.sync import build_sync
    from verl_async.trainer import FSDPWorkerGroup

    record: dict[str, Any] = {"args": vars(args)}
    if args.device == "cuda":
        record["bandwidth"] = measure_bandwidth(args.bandwidth_mib)
        print(f"ceilings: {record['bandwidth']}", flush=True)
    cache = os.environ.get("VERL_ASYNC_CACHE") or os.path.expanduser("~/.cache/verl_async")
    model = build_model(os.path.join(cache, "bench_models", "tiny" if args.tiny else "qwen2.5-0.5b-shape"), args.tiny)
    overrides = [f"actor_rollout_ref.model.path={model}", f"trainer.device={args.device}",
                 f"trainer.n_gpus_per_node={args.trainer_gpus}", "actor_rollout_ref.actor.optim.lr=1e-3",
                 f"actor_rollout_ref.rollout.name={args.engine}", "actor_rollout_ref.rollout.max_num_seqs=8",
                 "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
                 "data.max_prompt_length=64", "data.max_response_length=64", "trainer.worker_timeout_s=600"]
    cfg = compose(overrides, args.engine, args.device, 8)
    transport = "nccl" if args.device == "cuda" else "gloo"
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    group = FSDPWorkerGroup(cfg, name="sync_check_trainer")
    try:
        t0 = time.perf_counter()
        target = ray.remote(SyncTarget).options(num_cpus=0.1, max_concurrency=100).remote(
            args.replicas, cfg.actor_rollout_ref.rollout, model, args.device)
        group.init()
        ray.get(target.weight_sync.remote("collective", "ranks"), timeout=args.timeout_s)
        record["startup_s"] = time.perf_counter() - t0
        mb_list = [int(x) for x in args.bucket_mb.split(",") if x]
        # --- bit-exactness: sync 0, one training step, sync 1 (checksums on every engine rank)
        sync = build_sync(transport, group, target, bucket_bytes=mb_list[0] << 20, timeout_s=args.timeout_s,
                          verify=True)
        m0 = sync.push(0)
        sums0 = dict(sync.last["sender"]["checksums"])
        batch = random_batch(4, 2, 32 if args.tiny else 256, 250, seed=1)
        batch["old_log_probs"] = group.compute_log_prob(batch)
        update = group.update(batch)
        m1 = sync.push(1)
        sums1 = dict(sync.last["sender"]["checksums"])
        changed = sum(sums0[k] != sums1[k] for k in sums1)
        per_receiver = {who: {"received_equal": got["checksums"] == sums1,
                              "loaded_checked": len(got.get("loaded_checksums") or {}),
                              "loaded_equal": all(sums1[k] == v for k, v in (got.get("loaded_checksums") or {}).items())}
                        for who, got in sync.last["receivers"].items()}
        exact = all(r["received_equal"] and r["loaded_equal"] for r in per_receiver.values()) and changed > 0
        record["bit_exact"] = {"ok": exact, "tensors": len(sums1), "changed_by_the_update": changed,
                               "receivers": per_receiver, "group_init_s": m0["timing_s/sync_group_init"],
                               "verified_sync_s": m1["timing_s/param_sync"], "grad_norm": update.get("actor/grad_norm")}
        print(f"bit-exact: {record['bit_exact']}", flush=True)
        # --- speed, on the same group: on CUDA a second group formed after close() hung (see RESULTS.md)
        sync.verify = False
        rows = []
        version = 2
        for mb in mb_list:
            for double_buffer in (True, False):
                sync.replan(mb << 20)
                sync.double_buffer = double_buffer
                times = []
                for i in range(args.repeats + 1):
                    m = sync.push(version)
                    version += 1
                    if i:  # the first push with a new plan warms it
                        times.append(m["timing_s/param_sync"])
                nbytes = sync.last["sender"]["bytes"]
                med = statistics.median(times)
                row = {"bucket_mb": mb, "double_buffer": double_buffer, "param_sync_s_median": med,
                       "param_sync_s_min": min(times), "buckets": sync.last["sender"]["buckets"], "bytes": nbytes,
                       "GBps": nbytes / med / 1e9, "group_init_s": record["bit_exact"]["group_init_s"],
                       "sender_gather_s": sync.last["sender"].get("gather_s")}
                link = record.get("bandwidth", {}).get("gpu0_to_gpu1_GBps")
                if link:
                    row["fraction_of_gpu0_to_gpu1_copy"] = row["GBps"] / link
                rows.append(row)
                print(json.dumps(row), flush=True)
        record["speed"] = rows
        best = min(rows, key=lambda r: r["param_sync_s_median"])
        record["best"] = best
        record["target_0.1s_met"] = best["param_sync_s_median"] <= 0.1
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1, default=str)
        print("| bucket MB | double buffer | buckets | param_sync s (median) | GB/s | vs GPU0->1 copy |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            frac = r.get("fraction_of_gpu0_to_gpu1_copy")
            print(f"| {r['bucket_mb']} | {r['double_buffer']} | {r['buckets']} | {r['param_sync_s_median']:.4f} | "
                  f"{r['GBps']:.1f} | {'-' if frac is None else f'{frac:.2f}'} |")
        print(f"bit-exact: {record['bit_exact']['ok']} ({record['bit_exact']['tensors']} tensors, "
              f"{record['bit_exact']['changed_by_the_update']} changed by the update); "
              f"best {best['param_sync_s_median']:.4f} s; target <= 0.1 s met: {record['target_0.1s_met']}", flush=True)
        # written before teardown: on CUDA leaving the group hung past the call limit (bench/RESULTS.md)
        sync.close()
    finally:
        group.shutdown()
        ray.shutdown()
    return 0 if record["bit_exact"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
