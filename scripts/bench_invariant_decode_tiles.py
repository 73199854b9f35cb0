#!/usr/bin/env python
"""Issue 41 on one CUDA GPU: which tile should the invariant linear give a decode step (<= DECODE_ROWS rows)?

Run from the repository root on the GPU machine (torch and triton only):

    PYTHONPATH=. python scripts/bench_invariant_decode_tiles.py --out bench/invariant_decode_tiles.json

For the linears of SmolLM2-135M and of Qwen2.5-0.5B (bf16) at M = 1, 16, 64 rows, each candidate tile (BLOCK_M,
BLOCK_N, warps, stages; the K step is the dtype's and never changes) is
1. compared bit for bit with the default tile (what the trainer's long calls use) on 1, 16, 64 and 256 rows: a
   tile that differs anywhere must not serve decode (exit 1 if the current VERL_ASYNC_INVARIANT_DECODE_TILE does);
2. timed inside a CUDA graph (as the engine's decode graphs pay it: no Python, no launch overhead), next to the
   default tile and torch's F.linear (cuBLAS with its default settings: the mode off).
Prints per model and M one decoder layer's linears summed per tile (SmolLM2: the launches of the engine's decode
step, q/k/v and gate/up fused; Qwen: the 7 modules), and the fastest tile that is bitwise equal.
Set the choice with VERL_ASYNC_INVARIANT_DECODE_TILE=BLOCK_M,BLOCK_N,warps,stages (triton_ops.DECODE_TILE).
`--train`: the same for the long calls (training, prefill) at 16,384 rows, VERL_ASYNC_INVARIANT_LINEAR_TILE.
`--smoke` checks the script on tiny shapes (CPU: TRITON_INTERPRET=1, bits only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_invariant_triton import QWEN05, TINY, torch_and_device, write_report  # noqa: E402

SMOLLM2 = {"q_proj": (576, 576, False), "k_proj": (192, 576, False), "v_proj": (192, 576, False),
           "o_proj": (576, 576, False), "gate_proj": (1536, 576, False), "up_proj": (1536, 576, False),
           "down_proj": (576, 1536, False), "lm_head": (49152, 576, False),
           "qkv (fused)": (960, 576, False), "gate_up (fused)": (3072, 576, False)}
LAYER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_LAYER = ("qkv (fused)", "o_proj", "gate_up (fused)", "down_proj")  # what the engine's decode step launches
TILES = [(16, 16, 4, 6), (16, 32, 4, 4), (16, 32, 4, 6), (16, 32, 2, 6), (16, 64, 4, 4), (16, 64, 4, 6),
         (16, 128, 4, 4), (32, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3)]
ROWS = (1, 16, 64)
# --train: tiles for the long calls (training, prefill: VERL_ASYNC_INVARIANT_LINEAR_TILE), timed at 16,384 rows
TRAIN_TILES = [(128, 128, 8, 3), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 4, 4), (128, 64, 4, 4),
               (64, 128, 4, 4), (128, 256, 8, 4), (128, 128, 8, 4)]
TRAIN_ROWS = (16384,)


def graph_seconds(torch, fn, reps: int = 50) -> float:
    """Seconds per call of `fn` replayed from a CUDA graph of `reps` calls (min of 5 replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def sweep(torch, device, shapes: dict, tiles, rows) -> list[dict]:
    import torch.nn.functional as F

    from verl_async.invariant import triton_ops

    gen = torch.Generator().manual_seed(0)
    out = []
    for name, (n, k, bias) in shapes.items():
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, torch.bfloat16)
        b = torch.randn(n, generator=gen).to(device, torch.bfloat16) if bias else None
        x = torch.randn(max(256, *rows), k, generator=gen).to(device, torch.bfloat16)
        base = triton_ops.matmul_config(n, k, w.dtype)
        ref = triton_ops.linear_forward(x, w, b, base)
        for tile in [None, *tiles]:
            cfg = base if tile is None else triton_ops.MatmulConfig(tile[0], tile[1], base.block_k, base.group_m,
                                                                     tile[2], tile[3])
            equal = all(torch.equal(triton_ops.linear_forward(x[:m], w, b, cfg), ref[:m]) for m in (*rows, 256)
                        if m <= 256) and all(torch.equal(triton_ops.linear_forward(x[:m], w, b, cfg),
                                                         triton_ops.linear_forward(x[:m], w, b, base)) for m in rows
                                             if m > 256)
            row = {"op": name, "tile": "torch" if tile is None else ",".join(map(str, tile)), "equal": equal}
            for m in rows:
                xm = x[:m]
                if device.type == "cuda":
                    fn = (lambda: F.linear(xm, w, b)) if tile is None else \
                        (lambda: triton_ops.linear_forward(xm, w, b, cfg))
                    row[f"us/{m}"] = graph_seconds(torch, fn) * 1e6
            out.append(row)
    return out


def summary(rows: list[dict], shapes: dict, ms) -> list[dict]:
    """Per M: one layer's linears summed per tile; the fastest bitwise-equal tile."""
    tiles = sorted({r["tile"] for r in rows}, key=lambda t: (t != "torch", t))
    by = {(r["op"], r["tile"]): r for r in rows}
    out = []
    layer = FUSED_LAYER if all(op in shapes for op in FUSED_LAYER) else LAYER
    for m in ms:
        for tile in tiles:
            members = [by[(op, tile)] for op in layer if (op, tile) in by]
            if members and all(f"us/{m}" in r for r in members):
                out.append({"rows": m, "tile": tile, "layer_us": sum(r[f"us/{m}"] for r in members),
                            "lm_head_us": by.get(("lm_head", tile), {}).get(f"us/{m}"),
                            "equal": all(r["equal"] for r in members)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, bits only (CPU: TRITON_INTERPRET=1)")
    p.add_argument("--train", action="store_true",
                   help="the long calls' tiles instead (TRAIN_TILES at 16,384 rows; VERL_ASYNC_INVARIANT_LINEAR_TILE)")
    args = p.parse_args(argv)
    torch, device = torch_and_device(args.smoke)
    from verl_async.invariant import triton_ops

    models = {"tiny": TINY} if args.smoke else {"smollm2-135m": SMOLLM2, "qwen2.5-0.5b": QWEN05}
    tiles = TILES[:2] if args.smoke else TRAIN_TILES if args.train else TILES
    ms = (200,) if args.smoke and args.train else TRAIN_ROWS if args.train else ROWS
    chosen = None if args.train else triton_ops.decode_tile()
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                    "decode_tile": chosen, "models": {}}
    bad = False
    for model, shapes in models.items():
        rows = sweep(torch, device, shapes, tiles, ms)
        table = summary(rows, shapes, ms)
        report["models"][model] = {"ops": rows, "layer": table}
        unequal = sorted({r["tile"] for r in rows if not r["equal"] and r["tile"] != "torch"})
        print(f"\n{model}: tiles NOT bitwise equal to the default: {unequal or 'none'}")
        bad |= chosen is not None and ",".join(map(str, chosen)) in unequal
        for m in ms:
            mine = [r for r in table if r["rows"] == m]
            if not mine:
                continue
            print(f"  M={m:<3} " + "  ".join(f"{r['tile']}: {r['layer_us']:.1f}us" + ("" if r["equal"] else "(!=)")
                                         for r in mine))
            best = min((r for r in mine if r["equal"] and r["tile"] != "torch"), key=lambda r: r["layer_us"])
            print(f"         fastest equal tile: {best['tile']} ({best['layer_us']:.1f}us per layer's linears)")
    write_report(report, args.out, "invariant_decode_tiles.json")
    if bad:
        print(f"the decode tile in use ({chosen}) is NOT bitwise equal to the default: set "
              f"{triton_ops.DECODE_TILE_ENV}=off or an equal tile")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
