"""Ulysses sequence parallelism benchmark (not a test): tokens/s and peak memory at long responses, SP=1 vs SP=2.

    python scripts/bench_ulysses.py --device cuda --gpus 2                 # 0.5B-shaped model, 2 GPUs
    python scripts/bench_ulysses.py --device cpu --tiny --gpus 2           # smoke check of the script itself

On `--gpus` ranks (one FSDP2 worker group each time, packed rows, varlen/flash attention) it times
`update()` and `compute_log_prob()` on the same synthetic long-response batches (bench_train.py's
model and batches) in three configurations:

  sp=1  budget B          every rank holds whole sequences, micro-batches of <= B tokens per GPU
  sp=2  budget B/2        the same micro-batches (a group holds 2 x B/2 = B), each sequence split over 2 GPUs
  sp=2  budget B          micro-batches of <= 2B tokens per group: sequences up to 2B tokens fit

and reports train/log-prob tokens per second (whole group and per GPU), step time and the peak
device memory of the step (the largest rank). The first pair shows what the all-to-all costs and
the activation memory it saves for the same work; the third what the longer budget buys.
Before timing, the SP=2 log-probs of a small batch are compared with SP=1's (max |diff|; bf16 on GPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_train import (QWEN25_05B, TINY, build_model_dir, compose, make_batch, timed_steps,  # noqa: E402
                         write_result)


def run(sp: int, budget: int, model_dir: str, args, batches, small) -> dict:
    from verl_async.trainer import FSDPWorkerGroup

    a = "actor_rollout_ref.actor"
    args.micro_tokens = budget
    args.set = [*args.base_set, f"{a}.ulysses_sequence_parallel_size={sp}", f"{a}.use_dynamic_bsz=true",
                "actor_rollout_ref.model.use_remove_padding=true",
                f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}"]
    group = FSDPWorkerGroup(compose(model_dir, args.gpus, args.attn, args), name=f"bench_sp{sp}_{budget}")
    try:
        info = group.init()
        small_lp = group.compute_log_prob(small)
        lp_time, _, step_time, tokens, mem = timed_steps(group, batches, args.warmup)
        steps = len(batches) - args.warmup
        return {"sp": sp, "budget_per_gpu": budget, "budget_per_micro_batch": budget * sp, "gpus": args.gpus,
                "attn": info[0]["attn_implementation"], "train_tokens_per_s": tokens / step_time,
                "train_tokens_per_s_per_gpu": tokens / step_time / args.gpus,
                "logprob_tokens_per_s_per_gpu": tokens / lp_time / args.gpus, "step_s": step_time / steps,
                "peak_mem_gb": mem, "tokens_per_step": tokens / steps, "_small_lp": small_lp}
    finally:
        group.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny model and batches (CPU smoke check)")
    p.add_argument("--gpus", type=int, default=2, help="trainer ranks (a multiple of 2)")
    p.add_argument("--budget", type=int, default=16384, help="B: ppo_max_token_len_per_gpu of the sp=1 run")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[256, 1024])
    p.add_argument("--response-len", type=int, nargs=2, default=[8192, 14000], help="long responses (< B - prompt)")
    p.add_argument("--tokens-per-gpu", type=int, default=49152, help="real tokens per step per GPU")
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--attn", default="auto", help="actor_rollout_ref.model.attn_implementation (auto|varlen|flash_attention_2)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--out", default="bench/ulysses_bench.json")
    args = p.parse_args(argv)
    if args.tiny:
        args.budget, args.tokens_per_gpu, args.n = 256, 768, 2
        args.prompt_len, args.response_len, args.steps, args.warmup = [4, 16], [96, 200], 2, 1
    args.offload, args.base_set = False, list(args.set)
    shape = TINY if args.tiny else QWEN25_05B
    tag = "_".join(str(shape[k]) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), f"verl_async_bench_qwen2_{tag}")
    build_model_dir(model_dir, shape)
    vocab = min(shape["vocab_size"], 151936) - 1
    batches = [make_batch(args.tokens_per_gpu * args.gpus, args.n, tuple(args.prompt_len), tuple(args.response_len),
                          vocab, seed=s) for s in range(args.steps + args.warmup)]
    small = make_batch(args.budget, 2, tuple(args.prompt_len), (args.response_len[0] // 4, args.response_len[0] // 2),
                       vocab, seed=99)
    import ray

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True, num_cpus=max(4, os.cpu_count() or 4))
    rows = []
    for sp, budget in ((1, args.budget), (2, args.budget // 2), (2, args.budget)):
        try:
            rows.append(run(sp, budget, model_dir, args, batches, small))
        except Exception as exc:  # noqa: BLE001 - one broken configuration must not hide the others
            traceback.print_exc()
            rows.append({"sp": sp, "budget_per_gpu": budget, "error": f"{type(exc).__name__}: {exc}"})
    base = next((r["_small_lp"] for r in rows if r.get("sp") == 1 and "_small_lp" in r), None)
    for r in rows:
        lp = r.pop("_small_lp", None)
        if lp is not None and base is not None:
            r["logprob_max_abs_diff_vs_sp1"] = float((lp - base).abs().max())
    print(f"\n{'sp':>3} {'B/gpu':>6} {'B/micro':>7} {'tok/s':>9} {'tok/s/gpu':>9} {'lp tok/s/gpu':>12} {'step s':>7} "
          f"{'peak GB':>8} {'|lp-sp1|':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['sp']:>3} {r['budget_per_gpu']:>6}  ERROR {r['error'][:100]}")
            continue
        print(f"{r['sp']:>3} {r['budget_per_gpu']:>6} {r['budget_per_micro_batch']:>7} {r['train_tokens_per_s']:>9.0f} "
              f"{r['train_tokens_per_s_per_gpu']:>9.0f} {r['logprob_tokens_per_s_per_gpu']:>12.0f} {r['step_s']:>7.2f} "
              f"{r['peak_mem_gb']:>8.2f} {r.get('logprob_max_abs_diff_vs_sp1', 0.0):>9.2e}")
    write_result(args.out, {"device": args.device, "tiny": args.tiny, "args": vars(args), "torch": torch.__version__,
                            "rows": rows}, args.device)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
