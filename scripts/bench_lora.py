"""LoRA vs full fine-tuning on one GPU (not a test): trainer memory, step time and the trainer's half of a weight sync.

    python scripts/bench_lora.py --device cuda                       # 0.5B-shaped random Qwen2, rank 64
    python scripts/bench_lora.py --device cuda --model /path/to/hf   # a real model folder
    python scripts/bench_lora.py --device cpu --tiny                 # smoke check of the script itself

For `lora_rank` 0 (full) and `--ranks` (LoRA, alpha = 2 x rank, all-linear) it starts one FSDP2 worker
group on `--gpus` GPUs and reports: trainable parameters; the device memory after init (weights +
optimizer state: LoRA keeps Adam moments for the adapters only and builds no reference copy, the
reference being the model with its adapters off); the peak memory and time of an update step with a KL
term (so the reference forward runs); and the trainer's half of a weight sync, timed as the object-store
transport does it (every parameter gathered, LoRA layers merged W + alpha/r B A, bf16, to host memory in
256 MiB buckets) and as the collective transports do it (gathered and merged on the device, not copied
out). LoRA syncs merged weights (verl_async/trainer/lora.py says why), so its sync moves as many bytes
as full fine-tuning; the merge adds a GEMM per adapted layer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_train import QWEN25_05B, TINY, build_model_dir, compose, make_batch, write_result  # noqa: E402


def run(rank: int, model_dir: str, args, batches) -> dict:
    from verl_async.sync.object_store import full_weights
    from verl_async.trainer import FSDPWorkerGroup

    a, m = "actor_rollout_ref.actor", "actor_rollout_ref.model"
    args.set = [*args.base_set, f"{m}.lora_rank={rank}", f"{m}.lora_alpha={2 * rank or 16}", f"{a}.use_kl_loss=true",
                f"{a}.use_dynamic_bsz=true", f"{m}.use_remove_padding=true"]
    group = FSDPWorkerGroup(compose(model_dir, args.gpus, "auto", args), name=f"bench_lora{rank}")
    try:
        info = group.init()
        after_init = max(i["allocated_bytes"] for i in info) / 2**30
        step_s, mem = [], 0.0
        for i, batch in enumerate(batches):
            batch["old_log_probs"] = group.compute_log_prob(batch)
            batch["ref_log_prob"] = group.compute_ref_log_prob(batch)
            t = time.perf_counter()
            out = group.update(batch)
            if i >= args.warmup:
                step_s.append(time.perf_counter() - t)
                mem = max(mem, out["perf/max_memory_allocated_gb"])
        sync_host, sync_device = [], []
        for i in range(args.syncs + 1):
            t = time.perf_counter()
            total = sum(tensor.numel() * tensor.element_size() for _, tensor in full_weights(group, dtype="bfloat16"))
            if i:
                sync_host.append(time.perf_counter() - t)
            t = time.perf_counter()
            group._call("device_gather_seconds", "bfloat16")  # noqa: SLF001 - the collective transports' trainer half
            if i:
                sync_device.append(time.perf_counter() - t)
        return {"lora_rank": rank, "params": info[0]["params"], "trainable_params": info[0]["trainable_params"],
                "mem_after_init_gb": after_init, "update_peak_mem_gb": mem, "update_s": sum(step_s) / len(step_s),
                "sync_to_host_s": sum(sync_host) / len(sync_host),
                "sync_on_device_s": sum(sync_device) / len(sync_device), "sync_bytes": total}
    finally:
        group.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny model and batches (CPU smoke check)")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--ranks", type=int, nargs="+", default=[64], help="LoRA ranks beside full fine-tuning")
    p.add_argument("--model", default=None, help="an HF model folder instead of the random 0.5B-shaped Qwen2")
    p.add_argument("--micro-tokens", type=int, default=16384)
    p.add_argument("--tokens-per-gpu", type=int, default=32768)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512])
    p.add_argument("--response-len", type=int, nargs=2, default=[256, 2048])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="bench/lora_bench.json")
    args = p.parse_args(argv)
    if args.tiny:
        args.micro_tokens, args.tokens_per_gpu, args.n = 256, 512, 2
        args.prompt_len, args.response_len, args.steps, args.syncs = [4, 16], [8, 48], 2, 1
        args.ranks = [4]
    args.offload, args.gradient_checkpointing, args.base_set = False, False, list(args.set)
    shape = TINY if args.tiny else QWEN25_05B
    model_dir = args.model or os.path.join(tempfile.gettempdir(), "verl_async_bench_qwen2_" + "_".join(
        str(shape[k]) for k in ("hidden_size", "num_hidden_layers", "vocab_size")))
    if not args.model:
        build_model_dir(model_dir, shape)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"] - 1
    batches = [make_batch(args.tokens_per_gpu * args.gpus, args.n, tuple(args.prompt_len), tuple(args.response_len),
                          vocab, seed=s) for s in range(args.steps + args.warmup)]
    import ray

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True, num_cpus=max(4, os.cpu_count() or 4))
    rows = [run(rank, model_dir, args, batches) for rank in [0, *args.ranks]]
    print(f"\n{'rank':>5} {'trainable':>12} {'init GB':>8} {'peak GB':>8} {'step s':>7} {'sync->host s':>12} "
          f"{'sync dev s':>10} {'sync GB':>8}")
    for r in rows:
        print(f"{r['lora_rank']:>5} {r['trainable_params']:>12,} {r['mem_after_init_gb']:>8.2f} "
              f"{r['update_peak_mem_gb']:>8.2f} {r['update_s']:>7.2f} {r['sync_to_host_s']:>12.2f} "
              f"{r['sync_on_device_s']:>10.2f} {r['sync_bytes'] / 2**30:>8.2f}")
    write_result(args.out, {"device": args.device, "model": model_dir, "args": vars(args), "torch": torch.__version__,
                            "rows": rows}, args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
