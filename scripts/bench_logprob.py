"""Micro-benchmark: log-prob + entropy from logits, chunked vs naive, on CPU.

    python scripts/bench_logprob.py                      # N=32768, V=152064, bf16 logits
    python scripts/bench_logprob.py --n 4096 --small-n 512 --threads 1

Each measurement runs in its own subprocess so peak memories are separable: the
child allocates the logits, notes its RSS, runs one variant and reports the peak RSS
(`ru_maxrss`) minus that baseline ("extra"). Variants: `chunked` =
`verl_async.algos.logprobs_and_entropy`, `naive` = full-vocabulary log_softmax in
float32 (`reference_logprobs_and_entropy`); each forward-only (no grad) and
forward+backward (grad of sum(logp) + sum(entropy) w.r.t. the logits; its extra
includes the logits' gradient, same dtype as the logits, which any method needs).

The full size does not fit everywhere: bf16 logits of 32k x 152k are 10 GB, and the
naive float32 softmax adds ~20 GB per copy. A run is made at full N only when
/proc/meminfo's MemAvailable covers its estimate with a margin; otherwise it is
measured at `--small-n` and scaled linearly in N (marked "extrapolated").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file from anywhere

GIB = 1024**3
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args: argparse.Namespace) -> None:
    import torch

    from verl_async.algos import logprobs_and_entropy
    from verl_async.algos.logprob import reference_logprobs_and_entropy

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    logits = torch.empty(args.n, args.v, dtype=getattr(torch, args.dtype))
    for s in range(0, args.n, 256):  # fill in place: no float32 temporary of the full size
        logits[s : s + 256].normal_(0.0, 2.0, generator=gen)
    labels = torch.randint(0, args.v, (args.n,), generator=gen)
    fn = logprobs_and_entropy if args.variant == "chunked" else reference_logprobs_and_entropy
    warm = logits[:2].clone().requires_grad_(args.grad)  # one-time kernel/thread-pool start-up, off the clock
    lp, en = fn(warm, labels[:2], temperature=args.temperature)
    if args.grad:
        (lp.sum() + en.sum()).backward()
    del warm, lp, en
    gc.collect()
    base = _rss_bytes()
    if args.grad:
        logits.requires_grad_()
    start = time.perf_counter()
    if args.variant == "chunked":
        logp, ent = fn(logits, labels, temperature=args.temperature, chunk_size=args.chunk_size)
    else:
        logp, ent = fn(logits, labels, temperature=args.temperature)
    if args.grad:
        (logp.sum() + ent.sum()).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "base": base, "peak": peak, "checksum": float(logp.sum() + ent.sum())}))


def estimate_bytes(variant: str, grad: bool, n: int, v: int, elem: int, chunk_rows: int) -> int:
    """Rough peak for the memory gate (logits + working set), generous on purpose."""
    logits = n * v * elem
    if variant == "chunked":
        work = 4 * chunk_rows * v * 4
        return logits * (2 if grad else 1) + work
    return logits * (2 if grad else 1) + n * v * 4 * (8 if grad else 5)


def _scale_extra(extra: int, variant: str, grad: bool, n: int, args: argparse.Namespace, elem: int) -> float:
    """Extra peak at full N from one measured at n: the naive copies grow with N; the
    chunked working set does not, only the logits' gradient (fwd+bwd) does."""
    if n == args.n:
        return extra
    if variant == "naive":
        return extra * args.n / n
    return extra + ((args.n - n) * args.v * elem if grad else 0)


def run_child(args: argparse.Namespace, variant: str, grad: bool, n: int) -> dict:
    cmd = [
        sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--n", str(n),
        "--v", str(args.v), "--dtype", args.dtype, "--threads", str(args.threads),
        "--temperature", str(args.temperature),
    ]  # fmt: skip
    if args.chunk_size:
        cmd += ["--chunk-size", str(args.chunk_size)]
    if grad:
        cmd.append("--grad")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} grad={grad} n={n} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=32768, help="tokens")
    p.add_argument("--v", type=int, default=152064, help="vocab size (Qwen2.5: 152064)")
    p.add_argument("--small-n", type=int, default=1024, help="N for runs that do not fit at full N")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--chunk-size", type=int, default=None, help="rows per chunk (default: ~256 MiB float32)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--margin-gib", type=float, default=6.0, help="MemAvailable left untouched")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    p.add_argument("--grad", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    from verl_async.algos.logprob import DEFAULT_CHUNK_BYTES

    elem = DTYPES[args.dtype]
    chunk_rows = args.chunk_size or max(1, DEFAULT_CHUNK_BYTES // (4 * args.v))
    print(
        f"# log-prob + entropy, N={args.n} V={args.v} logits={args.dtype} chunk={chunk_rows} rows "
        f"threads={args.threads} T={args.temperature}; logits {args.n * args.v * elem / GIB:.2f} GiB, "
        f"one N x V float32 copy {args.n * args.v * 4 / GIB:.2f} GiB; "
        f"load avg {os.getloadavg()[0]:.2f}, MemAvailable {_mem_available() / GIB:.1f} GiB"
    )
    rows = []
    for variant in ("chunked", "naive"):
        for grad in (False, True):
            need = estimate_bytes(variant, grad, args.n, args.v, elem, chunk_rows)
            fits = _mem_available() - args.margin_gib * GIB > need
            n = args.n if fits else args.small_n
            r = run_child(args, variant, grad, n)
            scale = args.n / n
            rows.append(
                {
                    "variant": variant,
                    "pass": "fwd+bwd" if grad else "fwd",
                    "measured_n": n,
                    "extrapolated": not fits,
                    "seconds": r["seconds"] * scale,
                    "tokens_per_s": n / r["seconds"],
                    "extra_peak_gib": _scale_extra(r["peak"] - r["base"], variant, grad, n, args, elem) / GIB,
                    "logits_gib": args.n * args.v * elem / GIB,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print("\n| variant | pass | measured N | time at N (s) | tokens/s | extra peak over logits (GiB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        note = " (extrapolated)" if r["extrapolated"] else ""
        print(
            f"| {r['variant']} | {r['pass']} | {r['measured_n']} | {r['seconds']:.1f}{note} | "
            f"{r['tokens_per_s']:.0f} | {r['extra_peak_gib']:.2f}{note} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
