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
  (weight bytes + KV bytes read) / measured device copy bandwidth (prefill not counted);
- with `--vllm` (CUDA only, needs vLLM; written against 0.26.0): the rollout's own vLLM engine
  (`verl_async.rollout.vllm_engine.VLLMEngine`: vLLM's AsyncLLM, what
  `actor_rollout_ref.rollout.name=vllm` serves) on the same GPU and the same workload, driven
  exactly like the native engine: per batch size the SAME prompt token ids and the SAME
  per-request target lengths as GenerateRequests (`max_tokens = target`, `ignore_eos`,
  temperature 1, top-k/top-p off; the engine asks vLLM for the sampled token's log-prob as our
  rollouts do), all submitted at once, timed after a warm-up at every batch size (other
  prompts, so no prefix-cache hits; Triton specializes kernels on a size of 1, so batch 1 is
  warmed apart). Each response's length is checked against its
  target; reported as vllm_s, vllm_tok_s (useful tokens / s) and
  native_vs_vllm = vllm_s / engine_s (> 1: the native engine is faster).
  Order, so neither holds memory while the other runs: the native engine (and HF) runs every
  batch first and is released (shutdown, del, gc, empty_cache; what stays reserved is
  reported), then ONE vLLM engine (max_num_seqs = the largest batch, like the native
  engine; gpu_memory_utilization = `--vllm-mem`, default 0.5; CUDA graphs on; engine seed
  `--seed`, no per-request seeds: vLLM samples seeded requests one by one) serves every
  batch and is shut down (`VLLMEngine.shutdown`). The engine is built the way a rollout
  replica builds it (`build_engine_from_config` -> `VLLMEngine.from_config` ->
  `engine_args_from_config`: token ids in/out, chunked prefill, prefix caching, processed
  log-probs, the weight-sync worker extension), and the environment of
  `scripts/device/run_all_gpu.sh` (VLLM_WORKER_MULTIPROC_METHOD=spawn,
  VLLM_USE_FLASHINFER_SAMPLER=0) is set unless already set. vLLM loads a folder: a local
  model folder as is; the random-weight model is written to a temporary folder first.
- with `--vllm-offline` (CUDA only, needs vLLM): vLLM's own offline entry point, `vllm.LLM.generate`,
  not through our adapter (issue 27): the same prompt token ids, one `vllm.SamplingParams` per
  request with `max_tokens = target` and `ignore_eos` (so each response has exactly its target
  length, checked), temperature 1, top-k/top-p off, the sampled token's log-prob
  (`logprobs=0`, what a rollout needs; `--vllm-offline-no-logprobs` drops it), no detokenizing;
  the LLM sized like the engines above (max_num_seqs = the largest batch, `--vllm-mem`, CUDA
  graphs, prefix caching, chunked prefill), a warm-up at every batch size, then one `generate` call per batch,
  timed. Reported as vllm_offline_s, vllm_offline_tok_s and native_vs_vllm_offline. It runs
  last, after the native engine and the adapter (`--vllm`) have been released.

CPU (tiny model, quick):
    python scripts/bench_engine.py --device cpu --batches 1,16,64,256 --out bench/engine_cpu.json
GPU (random-weight Qwen2.5-0.5B-shaped model in bf16, no hub access):
    python scripts/bench_engine.py --device cuda --out bench/engine_cuda.json
GPU, next to vLLM (the random-weight model as above, or a local model folder with --model):
    python scripts/bench_engine.py --device cuda --vllm --out bench/engine_vllm.json
    python scripts/bench_engine.py --device cuda --model /path/to/model --vllm --vllm-mem 0.5 --out bench/engine_vllm.json
GPU, next to vLLM through our adapter and vLLM's own LLM.generate:
    python scripts/bench_engine.py --device cuda --vllm --vllm-offline --out bench/engine_vllm_offline.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_async.rollout.engine import GenerateRequest, InferenceEngine, SamplingParams  # noqa: E402
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
TINY_DIR = os.path.join(tempfile.gettempdir(), "verl_async_bench_tiny")
# What scripts/device/run_all_gpu.sh exports for vLLM (and VLLMEngine.start sets the first):
# CUDA is live in this process when vLLM starts its engine core; the carried vLLM has no
# flashinfer, so its FlashInfer sampler import would fail.
VLLM_ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
VLLM_WARMUP_TOKENS = 8


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
    p.add_argument("--no-fast-decode", dest="fast_decode", action="store_false",
                   help="decode through the HF forward instead of the runner's FastDecoder (compare both paths)")
    p.add_argument("--kv-len-bucket", type=int, default=256)
    p.add_argument("--true-on-policy", action="store_true",
                   help="actor_rollout_ref.rollout.true_on_policy: the batch-invariant kernels (no HF baseline: the "
                        "model is patched in place)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: leave as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--vllm", action="store_true", help="also run the rollout's vLLM engine (AsyncLLM) on the same workload (cuda; needs vLLM)")
    p.add_argument("--vllm-mem", type=float, default=0.5, help="vLLM gpu_memory_utilization (default 0.5)")
    p.add_argument("--vllm-offline", action="store_true",
                   help="also time vLLM's own vllm.LLM.generate on the same workload (cuda; needs vLLM)")
    p.add_argument("--vllm-offline-no-logprobs", dest="vllm_offline_logprobs", action="store_false",
                   help="LLM.generate without the sampled token's log-prob (rollouts need it; default: with)")
    args = p.parse_args(argv)
    for flag, on in (("--vllm", args.vllm), ("--vllm-offline", args.vllm_offline)):
        if on and args.device != "cuda":
            p.error(f"{flag} runs vLLM on the GPU: it needs --device cuda (got --device {args.device})")
    if args.true_on_policy:
        from verl_async.invariant.shapes import worker_env

        os.environ.update(worker_env(args.device))  # CUDA without triton: cuBLAS settings, read at its first call
        args.hf = False
    if not 0.0 < args.vllm_mem <= 1.0:
        p.error(f"--vllm-mem is a fraction of GPU memory in (0, 1], got {args.vllm_mem}")
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
        from verl_async.models.loading import load_causal_lm
        from verl_async.models.tiny import build_tiny_model_dir

        path = build_tiny_model_dir(TINY_DIR)
        return load_causal_lm(path, dtype=dtype, attn_implementation="sdpa", device=spec.torch_device)
    if args.model == "qwen2.5-0.5b-random":
        config = Qwen2Config(**QWEN25_05B, eos_token_id=151645, pad_token_id=151643, bos_token_id=None)
        torch.manual_seed(args.seed)
        with torch.device(spec.torch_device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        return model.to(spec.torch_device)
    from verl_async.models.loading import load_causal_lm

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


async def generate_all(engine: InferenceEngine, prompts, lengths, tag: str, who: str) -> tuple[float, int]:
    """Every request at once through `engine.generate`, as a rollout replica drives either engine.

    Temperature 1, `max_tokens` = the target, `ignore_eos`: (wall seconds, useful tokens after the length check).
    """
    reqs = [
        GenerateRequest(f"{tag}-{i}", p, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, lengths))
    ]
    t0 = time.perf_counter()
    results = await asyncio.gather(*[engine.generate(r) for r in reqs])
    wall = time.perf_counter() - t0
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{who} returned errors: {bad[:3]}")
    return wall, check_lengths([len(r.token_ids) for r in results], lengths, who)


async def run_engine(engine: NativeEngine, prompts, lengths, tag: str):
    before = engine.profile()
    wall, _ = await generate_all(engine, prompts, lengths, tag, "native engine")
    after = engine.profile()
    static = ("weight_bytes", "kv_bytes_per_token", "peak_running")
    delta = {k: (v if k in static else v - before.get(k, 0)) for k, v in after.items()}
    return wall, delta


def check_lengths(got: list[int], targets: list[int], who: str) -> int:
    """The useful tokens of a run (sum of the targets) once every response has exactly its target length.

    Raises RuntimeError naming `who`, how many responses differ and the first few (index: got/target).
    """
    if len(got) != len(targets):
        raise RuntimeError(f"{who} returned {len(got)} responses for {len(targets)} requests")
    bad = [(i, g, t) for i, (g, t) in enumerate(zip(got, targets)) if g != t]
    if bad:
        shown = ", ".join(f"#{i}: {g}/{t}" for i, g, t in bad[:5])
        raise RuntimeError(f"{who} did not produce the target lengths: {len(bad)} of {len(targets)} responses "
                           f"differ (got/target {shown})")
    return sum(targets)


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


async def bench(args, spec) -> tuple[dict, list, str | None]:
    """The native engine (and HF generate) on every batch: (report, workloads, model folder for vLLM or None).

    Everything on the device (model, engine, graphs) is local here: once this returns, only
    garbage collection stands between it and free memory (release_device_memory).
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    if spec.kind != "cpu":
        spec.set_current()
    model = build_model(args, spec).eval().requires_grad_(False)
    vocab = model.get_output_embeddings().weight.shape[0]
    dtype = next(model.parameters()).dtype
    vllm_dir = vllm_model_dir(args, model) if args.vllm or args.vllm_offline else None
    bandwidth = copy_bandwidth(spec, nbytes=(1 << 26) if spec.kind == "cpu" else (1 << 30))
    max_model_len = model_len(args)
    rng = torch.Generator().manual_seed(args.seed)
    workloads = [(batch, *workload(args, batch, vocab, rng)) for batch in args.batch_list]
    # One engine for every batch size: graphs are captured (and the decode step compiled) once;
    # a batch of B requests simply keeps B of its slots busy.
    engine = NativeEngine(
        model=model,
        device=spec,
        max_num_seqs=max(args.batch_list),
        max_model_len=max_model_len,
        max_num_batched_tokens=max_batched_tokens(args),
        cuda_graphs=args.cuda_graphs,
        compile_decode=args.compile,
        fast_decode=args.fast_decode,
        kv_len_bucket=args.kv_len_bucket,
        seed=args.seed,
        true_on_policy=args.true_on_policy,
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
    report = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "device": describe_device(spec),
        "model": args.model,
        "dtype": str(dtype),
        "vocab_size": vocab,
        **meta,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "prompt_len": args.prompt_len,
        "response_len": {"median": args.median_len, "sigma": args.sigma, "max": args.max_len},
        "max_model_len": max_model_len,
        "cuda_graphs": args.cuda_graphs,
        "compile": args.compile,
        "fast_decode": args.fast_decode,
        "true_on_policy": args.true_on_policy,
        "torch_threads": torch.get_num_threads(),
        "warmup_s": warm_s,
        "graphs": graphs,
        "results": rows,
    }
    return report, workloads, vllm_dir


def model_len(args) -> int:
    bucket = args.kv_len_bucket
    return -(-(args.prompt_len + args.max_len) // bucket) * bucket


def max_batched_tokens(args) -> int:
    return max(8192, args.prompt_len * 64)


def release_device_memory(spec) -> int | None:
    """gc + empty the allocator's cache; the bytes torch still reserves on the device (None off CUDA)."""
    gc.collect()
    if spec.kind == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return int(torch.cuda.memory_reserved())
    return None


# ---------------------------------------------------------------- vLLM (--vllm)

def require_vllm() -> None:
    """Fail at once (before the native engine's minutes) when --vllm was asked for and vLLM is absent."""
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("bench_engine.py --vllm needs vLLM (written against 0.26.0), which is not installed here: "
                         "pip install 'verl_async[vllm]' (or scripts/device/prepare_vllm.sh), or drop --vllm")


def vllm_model_dir(args, model) -> str:
    """A folder vLLM can load holding the benchmarked weights: the tiny model's or a local one, else a temp copy."""
    if args.model == "tiny":
        return TINY_DIR
    if args.model == "qwen2.5-0.5b-random":
        path = tempfile.mkdtemp(prefix="verl_async_bench_vllm_")
        model.save_pretrained(path)  # the very random weights the native engine runs, in its dtype
        return path
    return args.model


def vllm_rollout_config(args, dtype: str) -> dict:
    """The rollout keys the vLLM engine is built from, sized like the native engine (max_num_seqs = largest batch)."""
    return {
        "name": "vllm",
        "dtype": dtype.removeprefix("torch."),
        "gpu_memory_utilization": args.vllm_mem,
        "max_num_seqs": max(args.batch_list),
        "max_num_batched_tokens": max_batched_tokens(args),
        "max_model_len": model_len(args),
        "enforce_eager": False,
        "seed": args.seed,
    }


def build_vllm_engine(args, model_dir: str, dtype: str) -> InferenceEngine:
    """The rollout's vLLM engine, built as a rollout replica builds it (vLLM itself starts in `start()`)."""
    from verl_async.rollout.registry import build_engine_from_config

    return build_engine_from_config(vllm_rollout_config(args, dtype), model_path=model_dir, device="cuda")


def warmup_prompts(args, vocab: int, seed: int) -> list[list[int]]:
    """As many prompts as the largest batch, drawn apart from the workloads' (no prefix-cache hits)."""
    rng = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (max(args.batch_list), args.prompt_len), generator=rng).tolist()


def vllm_version() -> str:
    try:
        import vllm
    except ImportError:
        return "?"
    return str(getattr(vllm, "__version__", "?"))


async def run_vllm(args, model_dir: str, dtype: str, vocab: int, workloads) -> tuple[dict, list[dict]]:
    """Build one vLLM engine, warm it, time every workload, shut it down: (info, [{batch, vllm_s, vllm_tok_s}])."""
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    engine = build_vllm_engine(args, model_dir, dtype)
    rows = []
    try:
        t0 = time.perf_counter()
        try:
            await engine.start()
        except ImportError as exc:
            raise SystemExit(f"bench_engine.py --vllm could not start vLLM (written against 0.26.0): {exc}") from exc
        build_s = time.perf_counter() - t0
        warm = warmup_prompts(args, vocab, seed=args.seed + 1)
        t0 = time.perf_counter()
        for batch in sorted(set(args.batch_list)):
            await generate_all(engine, warm[:batch], [VLLM_WARMUP_TOKENS] * batch, f"vllm-warm{batch}", "vLLM")
        warm_s = time.perf_counter() - t0
        version = vllm_version()
        print(f"vLLM {version}: built in {build_s:.1f}s, warm-up {warm_s:.1f}s", flush=True)
        for batch, prompts, lengths in workloads:
            wall, tokens = await generate_all(engine, prompts, lengths, f"vllm-b{batch}", "vLLM")
            rows.append({"batch": batch, "vllm_s": wall, "vllm_tok_s": tokens / wall})
            print(f"vLLM batch {batch}: {tokens} tokens in {wall:.2f}s = {tokens / wall:.1f} tok/s", flush=True)
    finally:
        await shutdown_vllm(engine)
    info = {
        "engine": f"{type(engine).__module__}.{type(engine).__qualname__}",
        "version": version,
        "engine_kwargs": dict(engine.engine_kwargs),
        "env": {k: os.environ.get(k) for k in VLLM_ENV},
        "build_s": build_s,
        "warmup_s": warm_s,
    }
    return info, rows


async def shutdown_vllm(engine: InferenceEngine) -> None:
    """`engine.shutdown()` (stops vLLM's engine core, whose process holds the GPU memory), then gc + empty_cache."""
    try:
        await engine.shutdown()
    except Exception as exc:  # noqa: BLE001  a failed shutdown must not hide the results (or the error)
        print(f"vLLM engine shutdown failed: {type(exc).__name__}: {exc}", flush=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def merge_vllm(rows: list[dict], vllm_rows: list[dict], key: str = "vllm") -> None:
    """Add KEY_s, KEY_tok_s and native_vs_KEY (= KEY_s / engine_s: > 1 when native is faster) to each row."""
    by_batch = {r["batch"]: r for r in vllm_rows}
    for row in rows:
        v = by_batch.get(row["batch"])
        if v is not None:
            row.update({f"{key}_s": v[f"{key}_s"], f"{key}_tok_s": v[f"{key}_tok_s"],
                        f"native_vs_{key}": v[f"{key}_s"] / row["engine_s"]})


# ---------------------------------------------------------------- vLLM's own LLM.generate (--vllm-offline)

def offline_sampling_kwargs(lengths: list[int], logprobs: bool = True) -> list[dict]:
    """vllm.SamplingParams keywords per request: exactly `length` tokens each (ignore_eos + max_tokens), sampled
    like our rollouts (temperature 1, top-k/top-p off, the sampled token's log-prob), token ids only."""
    extra = {"logprobs": 0} if logprobs else {}
    return [dict(max_tokens=int(n), ignore_eos=True, temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=[],
                 detokenize=False, **extra) for n in lengths]


def offline_llm_kwargs(args, model_dir: str, dtype: str) -> dict:
    """vllm.LLM's keywords, sized like the engines above (the adapter's own sizes, vllm_rollout_config)."""
    sizes = vllm_rollout_config(args, dtype)
    return {
        "model": model_dir, "dtype": sizes["dtype"], "gpu_memory_utilization": sizes["gpu_memory_utilization"],
        "max_num_seqs": sizes["max_num_seqs"], "max_num_batched_tokens": sizes["max_num_batched_tokens"],
        "max_model_len": sizes["max_model_len"], "enforce_eager": False, "seed": args.seed,
        "skip_tokenizer_init": True, "enable_prefix_caching": True, "enable_chunked_prefill": True,
    }


def offline_generate(llm, prompts, lengths, logprobs: bool, who: str = "vLLM LLM.generate") -> tuple[float, int]:
    """One `llm.generate` call over the batch: (seconds, useful tokens), each response's length checked."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(**kw) for kw in offline_sampling_kwargs(lengths, logprobs)]
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return wall, check_lengths([len(o.outputs[0].token_ids) for o in outs], list(lengths), who)


def run_vllm_offline(args, model_dir: str, dtype: str, vocab: int, workloads) -> tuple[dict, list[dict]]:
    """vllm.LLM built once, warmed, timed on every workload, shut down: (info, [{batch, vllm_offline_s, ...}])."""
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    kwargs = offline_llm_kwargs(args, model_dir, dtype)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    build_s = time.perf_counter() - t0
    rows = []
    try:
        warm = warmup_prompts(args, vocab, seed=args.seed + 2)  # other prompts than the adapter's warm-up
        warm_s = sum(offline_generate(llm, warm[:batch], [VLLM_WARMUP_TOKENS] * batch, args.vllm_offline_logprobs)[0]
                     for batch in sorted(set(args.batch_list)))
        print(f"vLLM {vllm_version()} LLM: built in {build_s:.1f}s, warm-up {warm_s:.1f}s", flush=True)
        for batch, prompts, lengths in workloads:
            wall, tokens = offline_generate(llm, prompts, lengths, args.vllm_offline_logprobs)
            rows.append({"batch": batch, "vllm_offline_s": wall, "vllm_offline_tok_s": tokens / wall})
            print(f"vLLM LLM.generate batch {batch}: {tokens} tokens in {wall:.2f}s = {tokens / wall:.1f} tok/s",
                  flush=True)
    finally:
        shutdown_offline(llm)
    info = {"entry": "vllm.LLM.generate", "version": vllm_version(), "llm_kwargs": kwargs,
            "logprobs": args.vllm_offline_logprobs, "build_s": build_s, "warmup_s": warm_s}
    return info, rows


def shutdown_offline(llm) -> None:
    """Stop the LLM's engine core (its process holds the GPU memory), then gc + empty_cache."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    try:
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception as exc:  # noqa: BLE001  a failed shutdown must not hide the results (or the error)
        print(f"vLLM LLM shutdown failed: {type(exc).__name__}: {exc}", flush=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    f"{'vLLM tok/s':>10} {'x vLLM':>6} {'roofline tok/s':>14} {'% roof':>6} {'prefill%':>8} {'ms/decode':>9} "
    f"{'LLM.gen tok/s':>13} {'x LLM':>6}"
)


def format_row(r: dict) -> str:
    hf = f"{r['hf_tok_s']:9.1f} {r['speedup_vs_hf']:6.2f}" if "hf_tok_s" in r else f"{'-':>9} {'-':>6}"
    vl = f"{r['vllm_tok_s']:10.1f} {r['native_vs_vllm']:6.2f}" if "vllm_tok_s" in r else f"{'-':>10} {'-':>6}"
    off = (f"{r['vllm_offline_tok_s']:13.1f} {r['native_vs_vllm_offline']:6.2f}" if "vllm_offline_tok_s" in r
           else f"{'-':>13} {'-':>6}")
    return (
        f"{r['batch']:5d} {r['tokens']:7d} {r['len_mean']:6.1f}/{r['len_max']:<6d} {r['engine_tok_s']:12.1f} {hf} {vl} "
        f"{r['roofline_tok_s']:14.1f} {100 * r['roofline_frac']:6.1f} {100 * r['prefill_share']:8.1f} "
        f"{r['decode_ms_per_step']:9.2f} {off}"
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.vllm or args.vllm_offline:
        require_vllm()
    spec = device_lib.resolve(args.device)
    print(HEADER, flush=True)
    report, workloads, vllm_dir = asyncio.run(bench(args, spec))
    report["vllm"] = report["vllm_offline"] = None
    if args.vllm or args.vllm_offline:
        try:
            reserved = release_device_memory(spec)  # the native engine's memory, before vLLM sizes its KV cache
            report["native_reserved_after_release_bytes"] = reserved
            print(f"native engine released: {(reserved or 0) / 2**30:.2f} GiB still reserved by torch", flush=True)
            if args.vllm:
                report["vllm"], vllm_rows = asyncio.run(
                    run_vllm(args, vllm_dir, report["dtype"], report["vocab_size"], workloads))
                merge_vllm(report["results"], vllm_rows)
            if args.vllm_offline:
                release_device_memory(spec)
                report["vllm_offline"], offline_rows = run_vllm_offline(
                    args, vllm_dir, report["dtype"], report["vocab_size"], workloads)
                merge_vllm(report["results"], offline_rows, key="vllm_offline")
        finally:
            if vllm_dir and vllm_dir.startswith(os.path.join(tempfile.gettempdir(), "verl_async_bench_vllm_")):
                shutil.rmtree(vllm_dir, ignore_errors=True)
        print(HEADER)
        for row in report["results"]:
            print(format_row(row))
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
