#!/usr/bin/env python
"""Native engine throughput: tokens/s at several batch sizes on a long-tail length mix.

For each batch size B, B requests with one fixed-length random prompt each and a target
response length drawn from a log-normal (the GRPO long tail) run with `ignore_eos` and
`max_tokens = target`, all submitted at once to an engine with max_num_seqs = B. Reported
next to it:
- HF `generate` on the same prompts (one padded batch, sampling, run to the longest target,
  the way a static batch must), counted in useful tokens (sum of targets) per second;
- the memory-bandwidth roofline: every decode step must read the weights once plus the K/V
  of every cached token it attends to; roofline time = sum over the engine's decode steps of
  (weight bytes + KV bytes read) / measured device copy bandwidth (prefill not counted).

CPU (tiny model, quick):
    python scripts/bench_engine.py --device cpu --batches 1,16,64,256 --out bench/engine_cpu.json
GPU (random-weight Qwen2.5-0.5B-shaped model in bf16, no hub access):
    python scripts/bench_engine.py --device cuda --out bench/engine_cuda.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_async.rollout.engine import GenerateRequest, SamplingParams  # noqa: E402
from verl_async.rollout.native import NativeEngine  # noqa: E402
from verl_async.utils import device as device_lib  # noqa: E402

QWEN25_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=device_lib.DEVICE_KINDS)
    p.add_argument("--model", default=None, help="'tiny', 'qwen2.5-0.5b-random' or a local HF folder (default: tiny on cpu, qwen-shaped otherwise)")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--prompt-len", type=int, default=None, help="default 16 on cpu, 128 otherwise")
    p.add_argument("--median-len", type=float, default=None, help="median response length (default 24 on cpu, 256 otherwise)")
    p.add_argument("--sigma", type=float, default=0.9, help="log-normal sigma of response lengths")
    p.add_argument("--max-len", type=int, default=None, help="response length cap (default 96 on cpu, 2048 otherwise)")
    p.add_argument("--hf", dest="hf", action="store_true", default=True, help="also time HF generate (default)")
    p.add_argument("--no-hf", dest="hf", action="store_false")
    p.add_argument("--hf-max-batch", type=int, default=256, help="skip the HF baseline above this batch size")
    p.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_true", default=None)
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (opt-in)")
    p.add_argument("--kv-len-bucket", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: leave as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    args.model = args.model or ("tiny" if cpu else "qwen2.5-0.5b-random")
    args.prompt_len = args.prompt_len or (16 if cpu else 128)
    args.median_len = args.median_len or (24.0 if cpu else 256.0)
    args.max_len = args.max_len or (96 if cpu else 2048)
    args.batch_list = [int(b) for b in args.batches.split(",") if b.strip()]
    return args


def build_model(args, spec):
    from transformers import AutoModelForCausalLM, Qwen2Config

    dtype = device_lib.default_dtype(spec.kind)
    if args.model == "tiny":
        from verl_async.models import build_tiny_model_dir, load_causal_lm

        path = build_tiny_model_dir(os.path.join(tempfile.gettempdir(), "verl_async_bench_tiny"))
        return load_causal_lm(path, dtype=dtype, attn_implementation="sdpa", device=spec.torch_device)
    if args.model == "qwen2.5-0.5b-random":
        config = Qwen2Config(**QWEN25_05B, eos_token_id=151645, pad_token_id=151643, bos_token_id=None)
        torch.manual_seed(args.seed)
        with torch.device(spec.torch_device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        return model.to(spec.torch_device)
    from verl_async.models import load_causal_lm

    return load_causal_lm(args.model, dtype=dtype, attn_implementation="sdpa", device=spec.torch_device)


def copy_bandwidth(spec, nbytes: int = 1 << 28, reps: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a large tensor copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=spec.torch_device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    spec.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    spec.synchronize()
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def workload(args, batch: int, vocab: int, rng: torch.Generator):
    prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=rng).tolist()
    mu = math.log(args.median_len)
    lengths = torch.exp(mu + args.sigma * torch.randn(batch, generator=rng, dtype=torch.float64))
    lengths = lengths.round().clamp(1, args.max_len).long().tolist()
    return prompts, lengths


async def run_engine(engine: NativeEngine, prompts, lengths, tag: str):
    reqs = [
        GenerateRequest(f"{tag}-{i}", p, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, lengths))
    ]
    before = engine.profile()
    t0 = time.perf_counter()
    results = await asyncio.gather(*[engine.generate(r) for r in reqs])
    wall = time.perf_counter() - t0
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"engine returned errors: {bad[:3]}")
    got = [len(r.token_ids) for r in results]
    if got != lengths:
        raise RuntimeError("engine did not produce the target lengths")
    after = engine.profile()
    static = ("weight_bytes", "kv_bytes_per_token", "peak_running")
    delta = {k: (v if k in static else v - before.get(k, 0)) for k, v in after.items()}
    return wall, delta


def run_hf_generate(model, prompts, lengths, spec, pad_id: int) -> float:
    from transformers import GenerationConfig

    ids = torch.tensor(prompts, device=spec.torch_device)
    new = max(lengths)
    cfg = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new, eos_token_id=None, pad_token_id=pad_id,
    )
    with torch.inference_mode():
        spec.synchronize()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        spec.synchronize()
        wall = time.perf_counter() - t0
    if out.shape[1] != ids.shape[1] + new:
        raise RuntimeError(f"HF generate stopped early: {out.shape[1] - ids.shape[1]} of {new} tokens")
    return wall


async def bench(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = device_lib.resolve(args.device)
    if spec.kind != "cpu":
        spec.set_current()
    model = build_model(args, spec).eval().requires_grad_(False)
    vocab = model.get_output_embeddings().weight.shape[0]
    bandwidth = copy_bandwidth(spec, nbytes=(1 << 26) if spec.kind == "cpu" else (1 << 30))
    bucket = args.kv_len_bucket
    max_model_len = -(-(args.prompt_len + args.max_len) // bucket) * bucket
    rng = torch.Generator().manual_seed(args.seed)
    workloads = [(batch, *workload(args, batch, vocab, rng)) for batch in args.batch_list]
    # One engine for every batch size: graphs are captured (and the decode step compiled) once;
    # a batch of B requests simply keeps B of its slots busy.
    engine = NativeEngine(
        model=model,
        device=spec,
        max_num_seqs=max(args.batch_list),
        max_model_len=max_model_len,
        max_num_batched_tokens=max(8192, args.prompt_len * 64),
        cuda_graphs=args.cuda_graphs,
        compile_decode=args.compile,
        kv_len_bucket=bucket,
        seed=args.seed,
    )
    rows = []
    try:
        t0 = time.perf_counter()
        graphs = await engine.warmup(max(args.batch_list), args.prompt_len + args.max_len)
        await run_engine(engine, [w[1][0] for w in workloads], [4] * len(workloads), "prime")
        warm_s = time.perf_counter() - t0
        print(f"warmup: {graphs} decode graphs, {warm_s:.1f}s", flush=True)
        for batch, prompts, lengths in workloads:
            wall, prof = await run_engine(engine, prompts, lengths, f"b{batch}")
            rows.append(summarize(batch, lengths, wall, prof, bandwidth))
            if args.hf and batch <= args.hf_max_batch:
                pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
                run_hf_generate(model, prompts[:1], [2], spec, pad_id)  # prime
                hf_s = run_hf_generate(model, prompts, lengths, spec, pad_id)
                rows[-1].update(hf_s=hf_s, hf_tok_s=sum(lengths) / hf_s, speedup_vs_hf=hf_s / wall)
            print(format_row(rows[-1]), flush=True)
        meta = {k: prof[k] for k in ("weight_bytes", "kv_bytes_per_token")}
    finally:
        await engine.shutdown()
    return {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "device": describe_device(spec),
        "model": args.model,
        "dtype": str(next(model.parameters()).dtype),
        **meta,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "prompt_len": args.prompt_len,
        "response_len": {"median": args.median_len, "sigma": args.sigma, "max": args.max_len},
        "cuda_graphs": args.cuda_graphs,
        "compile": args.compile,
        "torch_threads": torch.get_num_threads(),
        "warmup_s": warm_s,
        "graphs": graphs,
        "results": rows,
    }


def summarize(batch: int, lengths: list[int], wall: float, prof: dict, bandwidth: float) -> dict:
    tokens = sum(lengths)
    roof_s = (prof["decode_steps"] * prof["weight_bytes"] + prof["decode_kv_tokens"] * prof["kv_bytes_per_token"]) / bandwidth
    return {
        "batch": batch,
        "tokens": tokens,
        "len_mean": tokens / batch,
        "len_max": max(lengths),
        "engine_s": wall,
        "engine_tok_s": tokens / wall,
        "decode_steps": int(prof["decode_steps"]),
        "mean_decode_batch": prof["decode_rows"] / max(prof["decode_steps"], 1),
        "decode_ms_per_step": 1000 * prof["decode_s"] / max(prof["decode_steps"], 1),
        "prefill_share": prof["prefill_s"] / wall,
        "roofline_tok_s": tokens / roof_s if roof_s else float("nan"),
        "roofline_frac": roof_s / wall,
    }


def describe_device(spec) -> str:
    if spec.kind == "cuda":
        return torch.cuda.get_device_name(spec.index)
    return f"{spec.kind} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


HEADER = (
    f"{'batch':>5} {'tokens':>7} {'len mean/max':>13} {'engine tok/s':>12} {'HF tok/s':>9} {'x HF':>6} "
    f"{'roofline tok/s':>14} {'% roof':>6} {'prefill%':>8} {'ms/decode':>9}"
)


def format_row(r: dict) -> str:
    hf = f"{r['hf_tok_s']:9.1f} {r['speedup_vs_hf']:6.2f}" if "hf_tok_s" in r else f"{'-':>9} {'-':>6}"
    return (
        f"{r['batch']:5d} {r['tokens']:7d} {r['len_mean']:6.1f}/{r['len_max']:<6d} {r['engine_tok_s']:12.1f} {hf} "
        f"{r['roofline_tok_s']:14.1f} {100 * r['roofline_frac']:6.1f} {100 * r['prefill_share']:8.1f} "
        f"{r['decode_ms_per_step']:9.2f}"
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    print(HEADER, flush=True)
    report = asyncio.run(bench(args))
    print(f"device: {report['device']}  model: {report['model']} ({report['dtype']})  "
          f"copy bandwidth: {report['copy_bandwidth_GBps']:.1f} GB/s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
