#!/usr/bin/env python
"""Where the native engine's host time goes per decode step (CPU, tiny model: the forward is small).

Runs B requests (ignore_eos, fixed response length) on an engine with max_num_seqs = B and
splits the worker's step time into: scheduler (admit + finish), forward (the model call of a
decode step), sampling (sample_tokens), and the rest of the decode step (input building,
device->host copy, per-sequence appends and stop checks, counters, retire/compaction,
delivery). Times are per decode step, in microseconds. `--cprofile` prints the top functions
of the worker thread at the largest batch.

    python scripts/profile_engine_host.py --batches 1,16,64,128 --tokens 192
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_async.models.loading import load_causal_lm  # noqa: E402
from verl_async.models.tiny import build_tiny_model_dir  # noqa: E402
from verl_async.rollout.engine import GenerateRequest, SamplingParams  # noqa: E402
from verl_async.rollout.native import NativeEngine  # noqa: E402
from verl_async.rollout.native import engine as engine_mod  # noqa: E402


SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2,
)


KERNELS = False


class Timer:
    def __init__(self):
        self.t = {}

    def wrap(self, name, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0

        return timed


def replay_us(eng, batch):
    """GPU time of one decode graph replay alone (CUDA): the floor of a step, no host work around it."""
    runner = eng._runner
    keys = sorted(k for k in runner._graphs if k[0] >= batch)
    if not keys:
        return float("nan")
    replay = runner._graphs[keys[-1]]
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / 50


def kernel_table(eng, batch):
    """CUDA kernels of one eager decode step (same work as a graph replay), by total GPU time."""
    from torch.profiler import ProfilerActivity, profile

    runner = eng._runner
    keys = sorted(k for k in runner._graphs if k[0] >= batch)
    if not keys:
        return ""
    b, kv = keys[-1]
    with torch.inference_mode():
        runner._graph_body(b, kv)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner._graph_body(b, kv)
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages()]
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA") / 5
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
    return f"batch bucket {b}, kv {kv}: {kernels:.0f} kernels per step\n{table}"


def run_batch(model, batch, tokens, prompt_len, temperature, profile, device="cpu", fast_decode=True):
    eng = NativeEngine(
        model=model, device=device, max_num_seqs=batch, max_model_len=prompt_len + tokens + 1, fast_decode=fast_decode,
    )
    timer = Timer()
    runner = eng._runner
    # the model call alone (eager on CPU; on CUDA it is a graph replay)
    runner._decode_fn = timer.wrap("forward", runner._decode_fn)
    runner.prefill = timer.wrap("prefill", runner.prefill)
    eng._sched.admit = timer.wrap("sched", eng._sched.admit)
    eng._sched.finish = timer.wrap("sched", eng._sched.finish)
    sample_name = "sample_with_plan" if hasattr(engine_mod, "sample_with_plan") else "sample_tokens"
    orig_sample = getattr(engine_mod, sample_name)
    setattr(engine_mod, sample_name, timer.wrap("sampling", orig_sample))
    prof = cProfile.Profile() if profile else None
    step = eng._step
    step_times = []

    def timed_step():
        t0 = time.perf_counter()
        if prof is not None:
            prof.runcall(step)
        else:
            step()
        step_times.append(time.perf_counter() - t0)

    eng._step = timed_step

    async def main():
        reqs = [
            GenerateRequest(
                f"r{i}",
                [(7 * i + j) % 200 + 3 for j in range(prompt_len)],
                SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True),
            )
            for i in range(batch)
        ]
        t0 = time.perf_counter()
        res = await asyncio.gather(*[eng.generate(r) for r in reqs])
        wall = time.perf_counter() - t0
        replay = replay_us(eng, batch) if device == "cuda" else float("nan")
        if device == "cuda" and KERNELS:
            print(kernel_table(eng, batch), flush=True)
        await eng.shutdown()
        assert all(r.ok and len(r.token_ids) == tokens for r in res)
        return wall, replay

    try:
        wall, replay = asyncio.run(main())
    finally:
        setattr(engine_mod, sample_name, orig_sample)
    p = eng.profile()
    steps = p["decode_steps"]
    total = sum(step_times)
    us = lambda s: 1e6 * s / steps  # noqa: E731
    # the first step is the prefill step (+ one decode); count it in the totals
    prefill = timer.t.get("prefill", 0.0)
    rest = total - prefill - sum(timer.t.get(k, 0.0) for k in ("forward", "sampling", "sched"))
    row = {
        "batch": batch,
        "decode_steps": steps,
        "step_us": us(total - prefill),
        "forward_us": us(timer.t.get("forward", 0.0)),
        "sampling_us": us(timer.t.get("sampling", 0.0)),
        "sched_us": us(timer.t.get("sched", 0.0)),
        "other_us": us(rest),
        "host_excl_forward_us": us(total - prefill - timer.t.get("forward", 0.0)),
        "wall_per_step_us": 1e6 * wall / steps,
        "replay_us": replay,
        "decode_us": 1e6 * p["decode_s"] / steps,
    }
    return row, prof


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", choices=["tiny", "smollm2"], help="smollm2: random SmolLM2-135M-shaped Llama in bf16")
    ap.add_argument("--repeat", type=int, default=1, help="runs per batch size; the fastest is reported")
    ap.add_argument("--kernels", action="store_true", help="CUDA: print the kernels of one decode step per batch")
    ap.add_argument("--no-fast-decode", dest="fast_decode", action="store_false",
                    help="decode through the HF forward instead of the runner's FastDecoder (compare both paths)")
    args = ap.parse_args(argv)
    global KERNELS
    KERNELS = args.kernels
    torch.set_num_threads(1)
    if args.shape == "smollm2":
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(**SMOLLM2_135M)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
        model = model.to(args.device).eval().requires_grad_(False)
    else:
        folder = build_tiny_model_dir(
            os.path.join(tempfile.gettempdir(), f"verl_async_prof_tiny_llama_{args.layers}"),
            hidden_size=64, num_layers=args.layers, family="llama",
        )
        model = load_causal_lm(folder, attn_implementation="sdpa").eval().requires_grad_(False).to(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    cols = ["batch", "step_us", "forward_us", "sampling_us", "sched_us", "other_us", "host_excl_forward_us", "wall_per_step_us"]
    if args.device == "cuda":
        cols += ["decode_us", "replay_us"]
    print(" ".join(f"{c:>12}" for c in cols))
    last_prof = None
    for b in batches:
        best = None
        for _ in range(args.repeat):
            profile = args.cprofile and b == batches[-1]
            row, prof = run_batch(model, b, args.tokens, args.prompt_len, args.temperature, profile, args.device, args.fast_decode)
            if best is None or row["step_us"] < best["step_us"]:
                best = row
            last_prof = prof or last_prof
        print(" ".join(f"{best[c]:12.1f}" if isinstance(best[c], float) else f"{best[c]:>12}" for c in cols), flush=True)
    if last_prof is not None:
        s = io.StringIO()
        pstats.Stats(last_prof, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())


if __name__ == "__main__":
    main()
