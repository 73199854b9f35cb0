"""FSDP2 / Megatron training throughput benchmark (not a test): tokens/s, step time, peak memory and MFU.

    python scripts/bench_train.py --device cuda --gpus 1 2          # the 0.5B-shaped run (H100/H200)
    python scripts/bench_train.py --device cpu --tiny --gpus 1 2    # smoke check of the script itself
    python scripts/bench_train.py --device cuda --gpus 1 --strategy fsdp2 megatron --attn varlen --layouts packed

For each world size x attention implementation it starts an `FSDPWorkerGroup` on a
random-weight Qwen2 model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads,
2 kv heads, intermediate 4864, vocab 151936, tied embeddings; ~494M parameters), then
times `update()` (one PPO/GRPO step: forward + backward + AdamW) on synthetic batches,
padded (fixed rows per micro-batch, sized so a padded micro-batch holds at most
`--micro-tokens`) and packed (padding-free, micro-batches of at most `--micro-tokens`
real tokens). It also times `compute_log_prob` (forward only).

    MFU = 6 * params * (real tokens / s / GPU) / (measured dense bf16 matmul FLOP/s of one GPU)

"real tokens" are prompt + response tokens without padding, so the padded layout pays
for its padding. Before timing, packed and padded log-probs of the same rows are
compared (max |diff|; bf16 on GPU, so ~1e-2 is normal, > 0.5 means a broken attention
path). Prints a table and writes JSON (`--out`).

`--strategy fsdp2 megatron`: the same model, batches, micro-token budget and timing for
the Megatron-core trainer (`MegatronWorkerGroup`, config `fully_async_ppo_megatron_trainer`,
TP = `--megatron-tp`, PP = 1, DP = world / TP), one row per world size beside the FSDP2
rows (`strategy` column). What differs, and is reported as such:

* layout: Megatron has no packing. Its rows are right-padded; the micro-batches hold a
  fixed number of rows sized like the FSDP `padded` layout (at most `--micro-tokens`
  padded tokens), whatever `--layouts` says (`layout` = "right-padded");
* attention: `--attn` is an FSDP (HF) setting; Megatron runs megatron-core's local layer
  spec (unfused `DotProductAttention`, no TransformerEngine) (`attn` = "mcore-local");
* `--offload` turns on `megatron.param_offload/grad_offload/optimizer_offload`;
* `params` (the MFU numerator) is the HF checkpoint's parameter count, as for FSDP2
  (Megatron's ranks hold shards when TP > 1); no packed-vs-padded check (n/a);
* `--profile` profiles FSDP2 rows only (Megatron ranks have no profiler hook: a note is
  printed).

`--profile DIR`: after the timed steps of each configuration, one more step (the last
batch again, not counted in the timings) runs under torch.profiler inside every trainer
rank; each rank writes `DIR/w<world>_<attn>_<layout>_rank<r>.json.gz` (Chrome trace) and
the row gets `profile`: per rank, device time by category (attention, GEMMs of MLP /
attention projections / LM head, log-prob + entropy, optimizer, grad clip, NCCL, ...),
by phase, and the step's wall time, device-busy time and idle gap (CUDA kernel time on
GPU, CPU op self time on CPU; verl_async/utils/profile_summary.py). Profiling slows the
step a little (wall_ms vs step_s shows how much).

    python scripts/bench_train.py --device cuda --gpus 1 --attn varlen --layouts packed --profile prof
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_async.protocol import Response, RolloutSample, collate_groups  # noqa: E402

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=512, tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=10000.0,
            rms_norm_eps=1e-6)


def build_model_dir(path: str, shape: dict) -> str:
    """Random-weight Qwen2 of `shape` + the byte tokenizer, in save_pretrained layout (cached)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_async.models.tiny import build_char_tokenizer

    config_file = os.path.join(path, "config.json")
    if os.path.exists(config_file):
        with open(config_file) as f:
            found = json.load(f)
        if all(found.get(k) == v for k, v in shape.items() if k in ("hidden_size", "num_hidden_layers", "vocab_size")):
            return path
        raise SystemExit(f"{path} holds a different model ({config_file}); pass another --model-dir")
    tok = build_char_tokenizer()
    config = Qwen2Config(**shape, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    return path


def matmul_flops(device: str, dtype: torch.dtype, n: int, reps: int) -> float:
    """Dense matmul FLOP/s of one device (the MFU denominator)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    rate = 2 * n**3 * reps / (time.perf_counter() - t)
    del a, b
    if device == "cuda":
        torch.cuda.empty_cache()
    return rate


def make_batch(target_tokens: int, n: int, prompt_len: tuple[int, int], response_len: tuple[int, int], vocab: int,
               seed: int):
    """Random groups of n responses until `target_tokens` real tokens; GRPO-like advantages."""
    rng = random.Random(seed)
    samples, tokens = [], 0
    while tokens < target_tokens:
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))]
        responses = []
        for _ in range(n):
            length = rng.randint(*response_len)
            responses.append(Response(token_ids=[rng.randrange(3, vocab) for _ in range(length)],
                                      log_probs=[0.0] * length, versions=[0] * length, finish_reason="stop",
                                      reward=rng.random()))
        sample = RolloutSample(uid=str(len(samples)), prompt_ids=prompt, responses=responses)
        samples.append(sample)
        tokens += sample.num_tokens
    batch = collate_groups(samples, pad_token_id=0)
    gen = torch.Generator().manual_seed(seed)
    batch["advantages"] = torch.randn(batch.batch_size[0], 1, generator=gen) * batch["response_mask"]
    return batch


def hf_param_count(model_dir: str) -> int:
    """Parameters of the HF checkpoint (tied embeddings stored once, as FSDP2 counts them)."""
    from safetensors import safe_open

    total = 0
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                for key in f.keys():
                    n = 1
                    for d in f.get_slice(key).get_shape():
                        n *= d
                    total += n
    return total


def compose(model_dir: str, world: int, attn: str, args, strategy: str = "fsdp2") -> object:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    a = "actor_rollout_ref.actor"
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.model.attn_implementation={attn}",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={args.gradient_checkpointing}",
        f"trainer.device={args.device}", f"trainer.n_gpus_per_node={world}", "trainer.worker_timeout_s=900",
        f"actor_rollout_ref.rollout.n={args.n}", f"{a}.ppo_mini_batch_size=100000", f"{a}.ppo_epochs=1",
        f"{a}.ppo_max_token_len_per_gpu={args.micro_tokens}", f"{a}.optim.lr=1e-6", f"{a}.use_kl_loss=false",
        f"{a}.entropy_coeff=0.0",
    ]
    if strategy == "megatron":
        name = "fully_async_ppo_megatron_trainer"
        overrides += [f"{a}.megatron.tensor_model_parallel_size={args.megatron_tp}",
                      *[f"{a}.megatron.{k}_offload={args.offload}" for k in ("param", "grad", "optimizer")]]
    else:
        name = "fully_async_ppo_trainer"
        overrides.append(f"{a}.fsdp_config.offload_policy={args.offload}")
    overrides += args.set
    with initialize_config_dir(config_dir=os.path.join(root, "config"), version_base=None):
        return hydra_compose(name, overrides=overrides)


def layout_options(layout: str, batch, micro_tokens: int) -> dict:
    if layout == "packed":
        return dict(use_remove_padding=True, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=micro_tokens,
                    log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=micro_tokens)
    longest = int(batch["attention_mask"].sum(dim=1).max())
    rows = max(1, micro_tokens // longest)
    return dict(use_remove_padding=False, use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu=rows,
                log_prob_use_dynamic_bsz=False, log_prob_micro_batch_size_per_gpu=rows)


MEGATRON_ATTN = "mcore-local"  # megatron-core's local layer spec: unfused DotProductAttention
MEGATRON_LAYOUT = "right-padded"
MEGATRON_NOTES = (  # in each Megatron row's notes and under the table
    "no packing: rows right-padded, fixed rows per micro-batch (FSDP padded sizing), whatever --layouts says",
    f"--attn does not apply: megatron-core local spec ({MEGATRON_ATTN}: unfused DotProductAttention)",
)


def timed_steps(group, batches, warmup: int) -> tuple[float, int, float, int, float]:
    """Old log-probs then an update per batch; after `warmup` batches: (log-prob seconds, tokens, update seconds,
    tokens, peak memory GB of the updates). Tokens are real ones (no padding)."""
    lp_time, lp_tokens, step_time, tokens, mem = 0.0, 0, 0.0, 0, 0.0
    for i, batch in enumerate(batches):
        t = time.perf_counter()
        batch["old_log_probs"] = group.compute_log_prob(batch)
        t_lp = time.perf_counter() - t
        t = time.perf_counter()
        m = group.update(batch)
        t_up = time.perf_counter() - t
        if i >= warmup:
            real = int(batch["attention_mask"].sum())
            lp_time, lp_tokens = lp_time + t_lp, lp_tokens + real
            step_time, tokens = step_time + t_up, tokens + real
            mem = max(mem, m["perf/max_memory_allocated_gb"])
    return lp_time, lp_tokens, step_time, tokens, mem


def write_result(path: str, result: dict, device: str) -> None:
    """The JSON of a benchmark (with the GPU's name on CUDA)."""
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {path}")


def make_group(strategy: str, world: int, attn: str, model_dir: str, args):
    # model.attn_implementation is an HF/FSDP key (Megatron ignores it): its default for Megatron
    cfg = compose(model_dir, world, "auto" if strategy == "megatron" else attn, args, strategy)
    if strategy == "megatron":
        from verl_async.trainer.megatron.worker_group import MegatronWorkerGroup

        return MegatronWorkerGroup(cfg, name=f"bench_megatron_{world}")
    from verl_async.trainer import FSDPWorkerGroup

    return FSDPWorkerGroup(cfg, name=f"bench_{world}_{attn}")


def bench_group(world: int, attn: str, model_dir: str, args, peak_flops: float, strategy: str = "fsdp2"
                ) -> list[dict]:
    megatron = strategy == "megatron"
    if megatron:
        attn = MEGATRON_ATTN
    rows: list[dict] = []
    group = None
    try:
        group = make_group(strategy, world, attn, model_dir, args)
        t = time.perf_counter()
        info = group.init()
        init_s = time.perf_counter() - t
        params = hf_param_count(model_dir) if megatron else info[0]["params"]
        vocab = min(args.vocab_sample, 151936)
        batches = [make_batch(args.tokens_per_gpu * world, args.n, tuple(args.prompt_len), tuple(args.response_len),
                              vocab, seed=s) for s in range(args.steps + args.warmup)]
        check = None
        if not megatron:  # Megatron has one (right-padded) layout: nothing to compare
            small = make_batch(args.micro_tokens, args.n, tuple(args.prompt_len), tuple(args.response_len), vocab,
                               99)
            group.set_options(**layout_options("packed", small, args.micro_tokens))
            packed_lp = group.compute_log_prob(small)
            group.set_options(**layout_options("padded", small, args.micro_tokens))
            padded_lp = group.compute_log_prob(small)
            check = float((packed_lp - padded_lp).abs().max())
        for layout in [MEGATRON_LAYOUT] if megatron else args.layouts:
            # Megatron: fixed rows per micro-batch, sized like FSDP's padded layout (<= micro_tokens padded tokens)
            group.set_options(**layout_options("padded" if megatron else layout, batches[0], args.micro_tokens))
            lp_time, lp_tokens, step_time, tokens, mem = timed_steps(group, batches, args.warmup)
            profile = None
            if args.profile and megatron:
                print("--profile: not for Megatron rows (its ranks have no profiler hook): skipped", flush=True)
            elif args.profile:
                tag = f"w{world}_{attn}_{layout}"
                profile = group.update(batches[-1], profile={"dir": os.path.abspath(args.profile), "tag": tag})[
                    "perf/profile"]
            tps = tokens / step_time
            rows.append({
                "strategy": strategy, "world": world, "attn": attn if megatron else info[0]["attn_implementation"],
                "layout": layout, "params": params,
                "micro_tokens": args.micro_tokens, "tokens_per_step": tokens / args.steps,
                "train_tokens_per_s": tps, "train_tokens_per_s_per_gpu": tps / world,
                "logprob_tokens_per_s_per_gpu": lp_tokens / lp_time / world,
                "mfu": 6 * params * tps / world / peak_flops, "peak_mem_gb": mem,
                "step_s": step_time / args.steps, "init_s": init_s, "packed_vs_padded_max_abs_diff": check,
            })
            if megatron:
                rows[-1].update(megatron_tp=args.megatron_tp, notes=[*MEGATRON_NOTES, *group.notes])
            print(json.dumps(rows[-1]), flush=True)
            if profile is not None:
                rows[-1]["profile"] = profile
    except Exception as exc:  # noqa: BLE001 - one broken configuration must not hide the others
        traceback.print_exc()
        rows.append({"strategy": strategy, "world": world, "attn": attn, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        if group is not None:
            group.shutdown()
    return rows


def print_table(rows: list[dict], peak_flops: float) -> None:
    print(f"\nmeasured dense matmul rate: {peak_flops / 1e12:.3f} TFLOP/s per device")
    head = (f"{'strategy':>8} {'gpus':>4} {'attn':>18} {'layout':>12} {'tok/s':>10} {'tok/s/gpu':>10} {'MFU':>6} "
            f"{'peak GB':>8} {'step s':>8} {'lp tok/s/gpu':>12} {'|packed-padded|':>15}")
    print(head)
    print("-" * len(head))
    for r in rows:
        strategy = r.get("strategy", "fsdp2")
        if "error" in r:
            print(f"{strategy:>8} {r['world']:>4} {r['attn']:>18}  ERROR {r['error'][:90]}")
            continue
        diff = r["packed_vs_padded_max_abs_diff"]
        print(f"{strategy:>8} {r['world']:>4} {r['attn']:>18} {r['layout']:>12} {r['train_tokens_per_s']:>10.0f} "
              f"{r['train_tokens_per_s_per_gpu']:>10.0f} {100 * r['mfu']:>5.1f}% {r['peak_mem_gb']:>8.2f} "
              f"{r['step_s']:>8.3f} {r['logprob_tokens_per_s_per_gpu']:>12.0f} "
              f"{'n/a' if diff is None else f'{diff:.2e}':>15}")
    if any(r.get("strategy") == "megatron" for r in rows):
        print("megatron rows: " + "; ".join(MEGATRON_NOTES) + "; params for MFU = the HF checkpoint's count")
    print_profiles(rows)


def print_profiles(rows: list[dict]) -> None:
    from verl_async.utils.profile_summary import format_table

    for r in rows:
        for summary in r.get("profile") or []:
            if summary:
                print("\n" + format_table(summary, f"profile: {r['world']} gpu(s) {r['attn']} {r['layout']} "
                                                   f"rank {summary['rank']} (step_s {r['step_s']:.3f})"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "npu", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny model and batches (CPU smoke check)")
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="world sizes to run")
    p.add_argument("--strategy", nargs="+", default=["fsdp2"], choices=["fsdp2", "megatron"],
                   help="trainers to run (megatron: right-padded micro-batches; --attn/--layouts are FSDP-only)")
    p.add_argument("--megatron-tp", type=int, default=1, help="Megatron tensor-parallel size (PP = 1)")
    p.add_argument("--attn", nargs="+", default=["sdpa", "varlen"], help="attention implementations")
    p.add_argument("--layouts", nargs="+", default=["packed", "padded"], choices=["packed", "padded"])
    p.add_argument("--micro-tokens", type=int, default=8192, help="ppo_max_token_len_per_gpu")
    p.add_argument("--tokens-per-gpu", type=int, default=65536, help="real tokens per training step per GPU")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512])
    p.add_argument("--response-len", type=int, nargs=2, default=[128, 2048])
    p.add_argument("--vocab-sample", type=int, default=151936, help="token ids are drawn below this")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--offload", action="store_true", help="fsdp_config.offload_policy (params/grads/optim on CPU)")
    p.add_argument("--true-on-policy", action="store_true",
                   help="actor_rollout_ref.rollout.true_on_policy=true (batch-invariant kernels; the attention span "
                        "is the longest prompt + response of --prompt-len/--response-len)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config override, e.g. actor_rollout_ref.actor.fsdp_config.grad_accum_no_sync=false")
    p.add_argument("--model-dir", default=None, help="reuse/cache the random model here")
    p.add_argument("--model", default=None, help="an existing HF model folder instead of the random Qwen2 (e.g. "
                                                 "SmolLM2's; pass --vocab-sample <= its vocabulary)")
    p.add_argument("--out", default="bench/train_bench.json")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile one extra step per configuration: Chrome traces in DIR, summary in the JSON")
    args = p.parse_args(argv)
    if args.tiny:
        args.micro_tokens = min(args.micro_tokens, 256)
        args.tokens_per_gpu = min(args.tokens_per_gpu, 768)
        args.n, args.prompt_len, args.response_len = 2, [4, 16], [8, 48]
        args.vocab_sample = min(args.vocab_sample, 500)
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    if args.true_on_policy:
        from verl_async.invariant.shapes import worker_env

        os.environ.update(worker_env(args.device))  # the Ray workers below inherit it (CUDA without triton: cuBLAS's)
        args.set += ["actor_rollout_ref.rollout.true_on_policy=true", f"data.max_prompt_length={args.prompt_len[1]}",
                     f"data.max_response_length={args.response_len[1]}"]
    shape = TINY if args.tiny else QWEN25_05B
    tag = "_".join(str(shape[k]) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    model_dir = args.model or args.model_dir or os.path.join(tempfile.gettempdir(), f"verl_async_bench_qwen2_{tag}")
    t = time.perf_counter()
    if not args.model:
        build_model_dir(model_dir, shape)
    print(f"model at {model_dir} ({time.perf_counter() - t:.0f}s)", flush=True)
    if args.device == "cpu":
        peak = matmul_flops("cpu", torch.float32, 512, 5)
    elif args.device == "cuda":
        peak = matmul_flops("cuda", torch.bfloat16, 8192, 50)
    else:
        import torch_npu  # noqa: F401

        peak = matmul_flops("npu", torch.bfloat16, 8192, 50)

    import ray

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True,
                 num_cpus=max(4, os.cpu_count() or 4) if args.device != "cpu" else 4)
    rows: list[dict] = []
    for strategy in args.strategy:
        for world in args.gpus:
            if strategy == "megatron":
                if world % args.megatron_tp:
                    rows.append({"strategy": strategy, "world": world, "attn": MEGATRON_ATTN,
                                 "error": f"world {world} is not a multiple of --megatron-tp {args.megatron_tp}"})
                    continue
                rows.extend(bench_group(world, MEGATRON_ATTN, model_dir, args, peak, strategy))
                continue
            for attn in args.attn:
                rows.extend(bench_group(world, attn, model_dir, args, peak, strategy))
    print_table(rows, peak)
    result = {"device": args.device, "tiny": args.tiny, "true_on_policy": args.true_on_policy,
              "matmul_flops_per_device": peak, "args": vars(args),
              "torch": torch.__version__, "rows": rows}
    write_result(args.out, result, args.device)
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
