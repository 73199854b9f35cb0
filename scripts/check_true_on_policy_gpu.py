#!/usr/bin/env python
"""True on-policy mode on one CUDA GPU: is it bitwise (bf16), and what does it cost (mode on vs off)?

Run from the repository root on the GPU machine (PYTHONPATH including the repo):

    python scripts/check_true_on_policy_gpu.py --out bench/true_on_policy_gpu.json

1. equality: `pytest -m gpu` over the true-on-policy tests (and the Triton kernels' own tests, natively): the
   engine's decode step replayed from its CUDA graphs against the HF forward bitwise; the kernel probes at the CUDA shapes
   (tests/test_invariant_ops.py: a row's bits do not depend on its batch for linear, RMSNorm, SiLU,
   attention incl. one decode query against a longer cache, log-prob), the native engine's
   batch-invariance and engine == FSDP2 trainer bitwise for a tiny Llama in bf16 (one micro-batch,
   one row each, a split; packed and padded; the training forward's first-mini-batch ratio exactly 1;
   across a weight sync that aborts responses and continues them), the hypothesis property over random
   batchings (tests/trainer/test_true_on_policy_property.py), every model family, and
   SmolLM2-135M-Instruct (`builtin://smollm2-135m-instruct`); the mode-off counterparts must differ.
   A failing probe names the kernel whose CUDA path depends on the batch.
2. price, each side in a process of its own (without triton the mode sets cuBLAS workspace settings, read when
   cuBLAS starts, so the "off" run keeps the default ones): scripts/bench_engine.py (native engine
   tokens/s on SmolLM2-135M, CUDA graphs on) and scripts/bench_train.py (FSDP2 step time, tokens/s
   and MFU on the random Qwen2.5-0.5B-shaped model, packed), with and without --true-on-policy.

Prints a table and writes one JSON with the test outcome, every bench row and the ratios.
`--skip-tests` / `--skip-bench` run one half. The benches' own JSON files go next to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_TESTS = [
    "tests/test_invariant_ops.py",
    "tests/rollout/test_native_invariant_decode.py",
    "tests/trainer/test_true_on_policy.py",
    "tests/trainer/test_true_on_policy_property.py",
    "tests/trainer/test_model_families.py::test_true_on_policy_trainer_recomputes_the_engine_log_probs_bitwise",
    "tests/test_real_model.py::test_true_on_policy_engine_and_trainer_agree_bitwise",
]
# the Triton kernels' own tests: unmarked, they run natively where there is a GPU (the CPU runs them interpreted)
KERNEL_TESTS = ["tests/test_invariant_triton.py", "tests/test_invariant_triton_softmax.py",
                "tests/test_invariant_triton_rope.py"]
MODEL = "builtin://smollm2-135m-instruct"


def run(cmd: list[str], env: dict, log: str) -> tuple[int, float]:
    """Run `cmd` from the repo root, tee its output to `log`; (exit status, seconds)."""
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            fh.write(line)
        rc = proc.wait()
    return rc, time.perf_counter() - t0


def base_env() -> dict:
    """This environment without the mode's BLAS settings (the "off" runs; the benches add them for "on")."""
    from verl_async.invariant import PROCESS_ENV

    env = {k: v for k, v in os.environ.items() if k not in PROCESS_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return env


def equality(args, out_dir: str) -> dict:
    from verl_async.invariant.shapes import worker_env

    env = {**base_env(), **worker_env("cuda")}  # with triton: none (no compared value comes from cuBLAS)
    junit = os.path.join(out_dir, "true_on_policy_gpu_tests.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *GPU_TESTS]
    rc, seconds = run(cmd, env, os.path.join(out_dir, "true_on_policy_gpu_tests.log"))
    kernels = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider",
               f"--junitxml={junit.replace('.xml', '_kernels.xml')}", *KERNEL_TESTS]
    rc_k, seconds_k = run(kernels, env, os.path.join(out_dir, "true_on_policy_gpu_kernel_tests.log"))
    return {"command": " ".join(cmd) + " ; " + " ".join(kernels), "exit_status": rc or rc_k,
            "passed": rc == 0 and rc_k == 0, "seconds": seconds + seconds_k, "junit": junit}


def engine_bench(args, out_dir: str, model_dir: str) -> dict:
    rows = {}
    for mode in ("off", "on"):
        out = os.path.join(out_dir, f"true_on_policy_engine_{mode}.json")
        cmd = [sys.executable, "scripts/bench_engine.py", "--device", "cuda", "--model", model_dir, "--no-hf",
               "--batches", args.engine_batches, "--prompt-len", "128", "--median-len", str(args.median_len),
               "--max-len", str(args.max_len), "--out", out] + (["--true-on-policy"] if mode == "on" else [])
        rc, _ = run(cmd, base_env(), out.replace(".json", ".log"))
        rows[mode] = json.load(open(out))["results"] if rc == 0 and os.path.exists(out) else {"error": rc}
    return rows


def train_bench(args, out_dir: str) -> dict:
    rows = {}
    for mode in ("off", "on"):
        out = os.path.join(out_dir, f"true_on_policy_train_{mode}.json")
        cmd = [sys.executable, "scripts/bench_train.py", "--device", "cuda", "--gpus", "1", "--attn", "varlen",
               "--layouts", "packed", "--tokens-per-gpu", str(args.train_tokens), "--steps", "2", "--warmup", "1",
               "--out", out] + (["--true-on-policy"] if mode == "on" else [])
        rc, _ = run(cmd, base_env(), out.replace(".json", ".log"))
        rows[mode] = json.load(open(out))["rows"] if rc == 0 and os.path.exists(out) else {"error": rc}
    return rows


def table(result: dict) -> None:
    if "equality" in result:
        e = result["equality"]
        print(f"\nequality tests (pytest -m gpu): {'PASSED' if e['passed'] else 'FAILED'} in {e['seconds']:.0f}s")
    eng = result.get("engine")
    if eng and all(isinstance(eng[m], list) for m in ("off", "on")):
        print(f"\n{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'off ms/step':>11} {'on ms/step':>10}")
        for off, on in zip(eng["off"], eng["on"]):
            print(f"{off['batch']:>5} {off['engine_tok_s']:>10.1f} {on['engine_tok_s']:>10.1f} "
                  f"{on['engine_tok_s'] / off['engine_tok_s']:>7.2f} {off['decode_ms_per_step']:>11.2f} "
                  f"{on['decode_ms_per_step']:>10.2f}")
    tr = result.get("train")
    if tr and all(isinstance(tr[m], list) and tr[m] and "error" not in tr[m][0] for m in ("off", "on")):
        off, on = tr["off"][0], tr["on"][0]
        print(f"\ntrainer (0.5B-shaped, packed): step {off['step_s']:.2f}s -> {on['step_s']:.2f}s "
              f"({on['step_s'] / off['step_s']:.2f}x), MFU {100 * off['mfu']:.1f}% -> {100 * on['mfu']:.1f}%, "
              f"log-prob tok/s/gpu {off['logprob_tokens_per_s_per_gpu']:.0f} -> {on['logprob_tokens_per_s_per_gpu']:.0f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/true_on_policy_gpu.json")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--engine-batches", default="1,16,64")
    p.add_argument("--median-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--train-tokens", type=int, default=16384, help="real tokens per trainer step")
    args = p.parse_args(argv)
    sys.path.insert(0, REPO)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this script checks the GPU path (the CPU tests cover the CPU)")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    from verl_async.invariant import triton_ops, triton_softmax
    from verl_async.rollout.native import invariant_decode

    knobs = (triton_ops.DECODE_TILE_ENV, triton_ops.LINEAR_TILE_ENV, triton_softmax.ATTN_TILE_ENV,
             invariant_decode.FUSE_ENV, triton_ops.USE_ENV)
    result: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "knobs": {k: os.environ.get(k) for k in knobs}}  # unset: the defaults
    if not args.skip_tests:
        result["equality"] = equality(args, out_dir)
    if not args.skip_bench:
        from verl_async.models.builtin import resolve_model_path

        result["engine"] = engine_bench(args, out_dir, resolve_model_path(MODEL))
        result["train"] = train_bench(args, out_dir)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    table(result)
    print(f"wrote {args.out}")
    ok = result.get("equality", {"passed": True})["passed"]
    ok = ok and all(not isinstance(v, dict) for part in ("engine", "train") for v in result.get(part, {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
