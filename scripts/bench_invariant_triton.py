#!/usr/bin/env python
"""Issue 41 item 2 on one CUDA GPU: are the Triton kernels (verl_async/invariant/triton_ops.py) batch-invariant
bit for bit, and what do they cost against torch (the mode off) and today's invariant CUDA path (ops.py's
fixed-shape chunks)?

Run from the repository root on the GPU machine (only torch and triton needed; torch's CUDA wheel brings triton):

    PYTHONPATH=. python scripts/bench_invariant_triton.py --out bench/invariant_triton.json

1. invariance (bf16 and fp32), for every Qwen2.5-0.5B linear (q/k/v with bias, o, gate/up, down, the LM head)
   and the RMSNorm: the rows of X[s:s+M] computed as a batch of M equal, bit for bit, the same rows inside one
   batch of the largest M, for M in --rows and offsets s that put every row at another tile position (also a
   view that does not start at the buffer's start). Any mismatch names the op, dtype, M and offset; exit 1.
2. config agreement (information for wiring, not a failure): do smaller row tiles (BLOCK_M 64/32/16, the rest
   unchanged) give the same bits as the default 128? If yes on this GPU, decode may use a smaller tile (the
   choice would then depend on M without changing a bit); if not, one tile size must serve every M.
3. price (bf16): tokens/s (rows/s) of each op at each M for torch (F.linear and HF's RMSNorm, measured in a
   subprocess WITHOUT the mode's cuBLAS settings: the mode-off baseline), today's invariant path (ops.linear with
   256-row chunks, ops.rms_norm with 1024-row chunks, under the mode's cuBLAS settings) and the Triton kernels;
   plus one decoder layer's linears + 2 norms and the LM head, summed. Ratios: triton / torch, triton / ops.

`--smoke` runs the same code on tiny shapes (on CPU under TRITON_INTERPRET=1 when there is no GPU) to check the
script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Callable, Optional

# Qwen2.5-0.5B: hidden 896, 14 query heads and 2 KV heads of 64, intermediate 4864, vocab 151936.
QWEN05 = {"q_proj": (896, 896, True), "k_proj": (128, 896, True), "v_proj": (128, 896, True),
          "o_proj": (896, 896, False), "gate_proj": (4864, 896, False), "up_proj": (4864, 896, False),
          "down_proj": (896, 4864, False), "lm_head": (151936, 896, False)}
TINY = {"q_proj": (48, 40, True), "down_proj": (40, 72, False), "lm_head": (300, 40, False)}
LAYER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,64,1024,16384", help="row counts M (comma-separated)")
    p.add_argument("--out", default=None, help="JSON file for every number (default: $OUT/... when OUT is set)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and rows (a check of this script)")
    p.add_argument("--skip-bench", action="store_true", help="invariance and config checks only")
    p.add_argument("--baseline-only", action="store_true", help=argparse.SUPPRESS)  # the torch subprocess
    p.add_argument("--reps", type=int, default=20, help="timed calls per measurement (min of 3 measurements)")
    return p.parse_args(argv)


def seconds_per_call(fn: Callable[[], object], reps: int, device, warmups: int = 3) -> float:
    """Seconds per call: min over 3 runs of `reps` calls (after `warmups` warm-up calls). Also used by
    scripts/bench_invariant_triton_softmax.py."""
    import torch

    for _ in range(warmups):
        fn()
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def torch_and_device(smoke: bool):
    """torch and the CUDA device; on a machine without one, the CPU for a --smoke check, else exit."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not smoke:
        sys.exit("no CUDA GPU: run with --smoke (and TRITON_INTERPRET=1) to check the script on CPU")
    return torch, device


def _inputs(torch, device, shapes, rows, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = {k for (_, k, _) in shapes.values()}
    xs = {k: torch.randn(max(rows) + 64, k, generator=gen).to(device, dtype) for k in hidden}
    ws = {name: (torch.randn(n, k, generator=gen).div_(k ** 0.5).to(device, dtype),
                 torch.randn(n, generator=gen).to(device, dtype) if bias else None)
          for name, (n, k, bias) in shapes.items()}
    return xs, ws


def baseline(args) -> dict:
    """Mode-off timings: F.linear and HF's RMSNorm (this process has torch's default cuBLAS settings)."""
    torch, device = torch_and_device(args.smoke)
    import torch.nn.functional as F

    shapes = TINY if args.smoke else QWEN05
    rows = [int(r) for r in args.rows.split(",")]
    xs, ws = _inputs(torch, device, shapes, rows, torch.bfloat16)
    out = {}
    for name, (w, b) in ws.items():
        for m in rows:
            x = xs[w.shape[1]][:m]
            out[f"{name}/{m}"] = seconds_per_call(lambda: F.linear(x, w, b), args.reps, device)
    hidden = min(xs)
    nw = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    for m in rows:
        x = xs[hidden][:m]

        def norm():
            h = x.float()
            return nw * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

        out[f"rms_norm/{m}"] = seconds_per_call(norm, args.reps, device)
    return out


def check_invariance(torch, device, shapes, rows, dtypes) -> list[dict]:
    from verl_async.invariant import triton_ops

    results = []
    big = max(rows)
    for dtype in dtypes:
        xs, ws = _inputs(torch, device, shapes, rows, dtype, seed=1)
        ops = {name: (lambda x, w=w, b=b: triton_ops.linear_forward(x, w, b)) for name, (w, b) in ws.items()}
        hidden = min(xs)
        nw = torch.randn(hidden, generator=torch.Generator().manual_seed(2)).to(device, dtype)
        ops["rms_norm"] = lambda x: triton_ops.rms_norm_forward(x, nw, 1e-6)
        in_dim = {name: ws[name][0].shape[1] for name in ws} | {"rms_norm": hidden}
        for name, op in ops.items():
            if dtype == torch.float32 and name == "lm_head" and big > 1024:
                m_list = [m for m in rows if m <= 1024]  # fp32 IEEE dot over 151936 columns: keep it short
            else:
                m_list = rows
            top = max(m_list)
            x_all = xs[in_dim[name]]
            full = op(x_all[: top + 37])  # one batch holding every row below
            for m in m_list:
                for s in sorted({0, 37 % (top + 37 - m + 1), top + 37 - m}):
                    got = op(x_all[s : s + m])
                    same = bool(torch.equal(got, full[s : s + m]))
                    row = {"op": name, "dtype": str(dtype).split(".")[-1], "rows": m, "offset": s, "equal": same}
                    if not same:
                        diff = (got.float() - full[s : s + m].float()).abs()
                        row["max_abs_diff"] = float(diff.max())
                        row["rows_differing"] = int((diff.amax(-1) > 0).sum())
                    results.append(row)
            del full
        del xs, ws
    return results


def check_configs(torch, device, shapes, rows) -> list[dict]:
    """Do smaller row tiles give the default tile's bits (bf16)? Information for wiring a decode config."""
    from verl_async.invariant import triton_ops

    xs, ws = _inputs(torch, device, shapes, rows, torch.bfloat16, seed=3)
    out = []
    for name in ("q_proj", "down_proj", "lm_head"):
        if name not in ws:
            continue
        w, b = ws[name]
        x = xs[w.shape[1]][: min(256, max(rows))]
        ref = triton_ops.linear_forward(x, w, b)
        base = triton_ops.matmul_config(*w.shape, w.dtype)
        for bm, warps in ((64, 4), (32, 4), (16, 4)):
            cfg = triton_ops.MatmulConfig(block_m=bm, block_n=base.block_n, block_k=base.block_k,
                                          group_m=base.group_m, num_warps=warps, num_stages=base.num_stages)
            got = triton_ops.linear_forward(x, w, b, cfg)
            row = {"op": name, "block_m": bm, "num_warps": warps, "equal_to_default": bool(torch.equal(got, ref))}
            if device.type == "cuda":
                for m in (1, 16, 64):
                    xm = x[:m]
                    row[f"s_per_call/{m}"] = seconds_per_call(lambda: triton_ops.linear_forward(xm, w, b, cfg), 20, device)
                    row[f"default_s_per_call/{m}"] = seconds_per_call(lambda: triton_ops.linear_forward(xm, w, b), 20, device)
            out.append(row)
    return out


def bench(torch, device, shapes, rows, reps) -> dict:
    """Seconds per call of today's invariant path (ops.py) and the Triton kernels, bf16."""
    from verl_async.invariant import ops, triton_ops
    from verl_async.invariant.shapes import CUDA

    xs, ws = _inputs(torch, device, shapes, rows, torch.bfloat16)
    out = {"ops": {}, "triton": {}}
    for name, (w, b) in ws.items():
        for m in rows:
            x = xs[w.shape[1]][:m]
            out["ops"][f"{name}/{m}"] = seconds_per_call(lambda: ops.linear(x, w, b, CUDA.linear_rows), reps, device)
            out["triton"][f"{name}/{m}"] = seconds_per_call(lambda: triton_ops.linear_forward(x, w, b), reps, device)
    hidden = min(xs)
    nw = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    for m in rows:
        x = xs[hidden][:m]
        out["ops"][f"rms_norm/{m}"] = seconds_per_call(lambda: ops.rms_norm(x, nw, 1e-6, CUDA.reduce_rows), reps, device)
        out["triton"][f"rms_norm/{m}"] = seconds_per_call(lambda: triton_ops.rms_norm_forward(x, nw, 1e-6), reps, device)
    return out


def table(times: dict, shapes, rows) -> list[dict]:
    """tokens/s per op and M for each path, a decoder layer (its linears + 2 norms) and the LM head."""
    groups = {name: [name] for name in list(shapes) + ["rms_norm"]}
    if all(n in shapes for n in LAYER):
        groups["layer (7 linears + 2 norms)"] = list(LAYER) + ["rms_norm", "rms_norm"]
    out = []
    for label, members in groups.items():
        for m in rows:
            row = {"op": label, "rows": m}
            for path in ("torch", "ops", "triton"):
                if all(f"{x}/{m}" in times[path] for x in members):
                    row[f"{path}_tok_s"] = m / sum(times[path][f"{x}/{m}"] for x in members)
            if "torch_tok_s" in row and "triton_tok_s" in row:
                row["triton_vs_torch"] = row["triton_tok_s"] / row["torch_tok_s"]
            if "ops_tok_s" in row and "triton_tok_s" in row:
                row["triton_vs_ops"] = row["triton_tok_s"] / row["ops_tok_s"]
            out.append(row)
    return out


def main(argv=None) -> int:
    args = _args(argv)
    if args.smoke and args.rows == "1,16,64,1024,16384":
        args.rows = "1,7,64"
    if args.baseline_only:
        print(json.dumps(baseline(args)))
        return 0
    # The mode's cuBLAS settings (read when cuBLAS starts) for today's invariant path, as a true-on-policy worker has.
    from verl_async.invariant.shapes import PROCESS_ENV

    os.environ.update(PROCESS_ENV)
    torch, device = torch_and_device(args.smoke)
    shapes = TINY if args.smoke else QWEN05
    rows = [int(r) for r in args.rows.split(",")]
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                    "torch": torch.__version__, "rows": rows}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError as e:
        sys.exit(f"triton is not importable: {e}")

    t0 = time.perf_counter()
    inv = check_invariance(torch, device, shapes, rows, [torch.bfloat16, torch.float32])
    bad = [r for r in inv if not r["equal"]]
    report["invariance"] = inv
    print(f"invariance: {len(inv) - len(bad)}/{len(inv)} (op, dtype, M, offset) cases bitwise equal "
          f"({time.perf_counter() - t0:.1f} s)")
    for r in bad:
        print(f"  NOT EQUAL: {r}")

    report["configs"] = check_configs(torch, device, shapes, rows)
    for r in report["configs"]:
        print(f"config {r['op']} BLOCK_M={r['block_m']} warps={r['num_warps']}: equal to the default tile: "
              f"{r['equal_to_default']}" + "".join(f"  {k}={v * 1e6:.1f}us" for k, v in r.items() if "/" in k))

    if not args.skip_bench:
        env = {k: v for k, v in os.environ.items() if k not in PROCESS_ENV}  # the mode off: default cuBLAS
        cmd = [sys.executable, os.path.abspath(__file__), "--baseline-only", "--rows", args.rows,
               "--reps", str(args.reps)] + (["--smoke"] if args.smoke else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            sys.exit(f"baseline subprocess failed:\n{done.stderr[-3000:]}")
        times = {"torch": json.loads(done.stdout.strip().splitlines()[-1])}
        times.update(bench(torch, device, shapes, rows, args.reps))
        report["seconds_per_call"] = times
        report["table"] = table(times, shapes, rows)
        print(f"\n{'op':<28}{'M':>7}{'torch tok/s':>14}{'ops tok/s':>14}{'triton tok/s':>14}"
              f"{'tri/torch':>10}{'tri/ops':>9}")
        for r in report["table"]:
            print(f"{r['op']:<28}{r['rows']:>7}{r.get('torch_tok_s', 0):>14,.0f}{r.get('ops_tok_s', 0):>14,.0f}"
                  f"{r.get('triton_tok_s', 0):>14,.0f}{r.get('triton_vs_torch', 0):>10.2f}"
                  f"{r.get('triton_vs_ops', 0):>9.2f}")

    write_report(report, args.out, "invariant_triton.json")
    return 1 if bad else 0


def write_report(report: dict, out: Optional[str], name: str) -> None:
    """The report as JSON at `out`, else at $OUT/`name` on a device machine, else nowhere."""
    out = out or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
