#!/usr/bin/env python
"""Issue 41 item 2 on one CUDA GPU: are the Triton attention and sampled-token log-prob
(verl_async/invariant/triton_softmax.py) batch-invariant bit for bit, and what do they cost against torch (the mode
off) and the chunked invariant CUDA path they replace?

Run from the repository root on the GPU machine (only torch and triton needed; torch's CUDA wheel brings triton):

    PYTHONPATH=. python scripts/bench_invariant_triton_softmax.py --out bench/invariant_triton_softmax.json

Shapes: Qwen2.5-0.5B (14 query heads, 2 KV heads of 64; vocab 151,936), spans 2048 and 4096.

1. invariance (exit 1 on any mismatch; each names the op, case, dtype and size):
   attention, bf16 and fp32: the trainer's call (all positions of S sequences, q a permuted view as
   `attention._token_layout` makes it) against the engine's: decode batches of 1/16/64 rows, each a sequence at
   its own position (0, block edges, the middle, the last) with the KV cache NaN past it; a continuation chunk of
   37 positions; one sequence alone; a decode batch whose q, k, v start 2 bytes off alignment; a sliding window
   (bf16). And the real layouts (`_token_layout` of packed sequences vs `_slot_layout` decode), bf16.
   log-prob, bf16 and fp32 logits, T = 1 and 0.7: rows M in --rows of one call of 16,421 rows, at three offsets,
   with and without the entropy, from float32 logits (what the engine passes), and from a buffer 2 bytes off
   alignment (another register layout: the lane sums must not care).
2. price (bf16), seconds per call -> tokens/s:
   attention decode (B rows at position span-1, all keys in use): SDPA (GQA, flash), the chunked path
   (`attention._attend` with VERL_ASYNC_INVARIANT_TRITON=0: 32-query tiles over the span), Triton;
   attention training (16,384 tokens: span-long sequences, causal): SDPA is_causal, chunked, Triton;
   log-prob (M rows x 151,936): torch `log_softmax(x.float() / T).gather`, the mode-off trainer's
   `algos.logprob.logprobs_from_logits` (eager chunks), the chunked invariant path (64-row fixed chunks), Triton;
   the same with the entropy (`logprobs_and_entropy`); Triton from float32 logits (the engine's call).
   One process; the mode's cuBLAS settings are set (they only matter to the chunked path's GEMMs).
`--attn-sweep` instead: each candidate attention tile (ATTN_TILES) checked for invariance and timed (training call
and a decode batch of 64) at the first span, beside SDPA; a tile is set with VERL_ASYNC_INVARIANT_ATTN_TILE.

`--smoke` runs the same code on tiny shapes (on CPU under TRITON_INTERPRET=1 when there is no GPU) to check the
script itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

from bench_invariant_triton import seconds_per_call, torch_and_device, write_report  # scripts/, beside this file

QWEN05 = {"heads": 14, "kv_heads": 2, "head_dim": 64, "vocab": 151936}
TINY = {"heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 300}
CHUNK = 37  # the continuation chunk's positions, and the log-prob buffer's extra rows (odd on purpose)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", default="2048,4096", help="attention spans (keys per sequence)")
    p.add_argument("--decode", default="1,16,64", help="decode batch sizes (rows)")
    p.add_argument("--rows", default="1,16,64,1024,16384", help="log-prob row counts M")
    p.add_argument("--train-tokens", type=int, default=16384, help="query tokens of the attention training call")
    p.add_argument("--check-tokens", type=int, default=8192, help="query tokens of the trainer's call (bf16 check)")
    p.add_argument("--out", default=None, help="JSON file for every number (default: $OUT/... when OUT is set)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a check of this script)")
    p.add_argument("--skip-bench", action="store_true", help="invariance checks only")
    p.add_argument("--reps", type=int, default=10, help="timed calls per measurement (min of 3 measurements)")
    p.add_argument("--attn-sweep", action="store_true",
                   help="only: time and check each candidate attention tile (ATTN_TILES) at the first span")
    a = p.parse_args(argv)
    if a.smoke:
        a.spans, a.decode, a.rows, a.train_tokens, a.check_tokens, a.reps = "48,80", "1,3", "1,5,33", 160, 96, 2
    return a


def _time(torch, fn: Callable[[], object], reps: int) -> float:
    """Seconds per call (bench_invariant_triton.seconds_per_call), after 2 warm-up calls: the chunked path is slow."""
    return seconds_per_call(fn, reps, torch.device("cuda" if torch.cuda.is_available() else "cpu"), warmups=2)


def _case(results: list, op: str, case: str, dtype, got, want, **info) -> None:
    """Record whether `got` equals `want` bit for bit (NaN == NaN counts as equal: both sides' padding)."""
    import torch

    same = bool(torch.equal(got, want)) or bool(torch.equal(got.nan_to_num(), want.nan_to_num())
                                               and torch.equal(got.isnan(), want.isnan()))
    row = {"op": op, "case": case, "dtype": str(dtype).split(".")[-1], **info, "equal": same}
    if not same:
        diff = (got.float() - want.float()).abs()
        row["max_abs_diff"] = float(diff.nan_to_num(nan=float("inf")).max())
        row["elements_differing"] = int((diff != 0).sum())
    results.append(row)


def _misaligned(torch, t):
    """A copy of `t` whose storage starts 2 bytes (one bf16) past an aligned address: Triton compiles another
    specialization, with other load layouts."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


# ---------------------------------------------------------------- attention


def _trainer_qkv(torch, device, shape, S, L, dtype, seed):
    """q as `_token_layout` hands it over ([S, G, R, L, D], a permuted view of [S, L, G, R, D]), k, v [S, G, L, D]."""
    H, G, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(S, L, G, H // G, D, generator=gen).to(device, dtype).permute(0, 2, 3, 1, 4)
    k = torch.randn(S, L, G, D, generator=gen).to(device, dtype).transpose(1, 2)
    v = torch.randn(S, L, G, D, generator=gen).to(device, dtype).transpose(1, 2)
    return q, k, v


def check_attention(torch, device, shape, spans, decode, dtypes, check_tokens) -> list[dict]:
    from verl_async.invariant import attention, triton_softmax

    rows: list[dict] = []
    D = shape["head_dim"]
    scale = D ** -0.5
    for dtype in dtypes:
        for L in spans:
            S = max(2, check_tokens // L) if dtype == torch.bfloat16 else 2
            q, k, v = _trainer_qkv(torch, device, shape, S, L, dtype, seed=L)
            pos = torch.arange(L, device=device).expand(S, L)
            windows = [None, L // 8] if dtype == torch.bfloat16 else [None]
            for window in windows:
                trained = triton_softmax.attention_forward(q, k, v, pos, scale, window)
                tag = {"span": L} | ({"window": window} if window else {})
                if window is None:
                    ref = torch.nn.functional.scaled_dot_product_attention(
                        q.reshape(S, -1, L, D), k, v, is_causal=True, scale=scale, enable_gqa=True)
                    rows.append({"op": "attention", "case": "vs SDPA (max abs diff)", "dtype": str(dtype)[6:], **tag,
                                 "max_abs_diff": float((trained.reshape(S, -1, L, D).float() - ref.float())
                                                       .abs().max()), "equal": True})
                edges = sorted({e for e in (0, 63, 64, L // 2, L - 1, 127, 1000 % L, L - 65) if 0 <= e < L})
                for B in decode:
                    seqs = [b % S for b in range(B)]
                    at = [edges[b % len(edges)] for b in range(B)]
                    kc = torch.stack([k[s] for s in seqs]).clone()
                    vc = torch.stack([v[s] for s in seqs]).clone()
                    for b, p in enumerate(at):
                        kc[b, :, p + 1 :] = float("nan")  # the cache's stale slots past the position
                        vc[b, :, p + 1 :] = float("nan")
                    qd = torch.stack([q[s, :, :, p] for s, p in zip(seqs, at)])[:, :, :, None]
                    pd = torch.tensor(at, device=device)[:, None]
                    want = torch.stack([trained[s, :, :, p] for s, p in zip(seqs, at)])
                    got = triton_softmax.attention_forward(qd, kc, vc, pd, scale, window)[:, :, :, 0]
                    _case(rows, "attention", "decode", dtype, got, want, **tag, batch=B)
                    if B == decode[len(decode) // 2] and window is None:
                        got = triton_softmax.attention_forward(*(_misaligned(torch, t) for t in (qd, kc, vc)), pd,
                                                               scale)[:, :, :, 0]
                        _case(rows, "attention", "decode, q/k/v 2 bytes off alignment", dtype, got, want, **tag,
                              batch=B)
                for p in sorted({0, min(L // 3, L - CHUNK), L - CHUNK}):
                    kc, vc = k[:1].clone(), v[:1].clone()
                    kc[:, :, p + CHUNK :] = float("nan")
                    vc[:, :, p + CHUNK :] = float("nan")
                    got = triton_softmax.attention_forward(q[:1, :, :, p : p + CHUNK], kc, vc,
                                                           torch.arange(p, p + CHUNK, device=device)[None], scale,
                                                           window)
                    _case(rows, "attention", "continuation chunk", dtype, got, trained[:1, :, :, p : p + CHUNK],
                          **tag, start=p)
                got = triton_softmax.attention_forward(q[S - 1 :], k[S - 1 :], v[S - 1 :], pos[S - 1 :], scale, window)
                _case(rows, "attention", "one sequence alone", dtype, got, trained[S - 1 :], **tag)
            del q, k, v
    rows += _check_layouts(torch, device, shape, spans)
    return rows


def _check_layouts(torch, device, shape, spans) -> list[dict]:
    """The wiring the engine and trainer run (use_triton on CUDA): packed tokens (`_token_layout`, the trainer)
    against decode steps through `_slot_layout` (the engine, its cache slot of the span's length)."""
    from verl_async.invariant import attention

    H, G, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    rows: list[dict] = []
    for span in spans:
        lengths = [span, span // 2 + 3, 7]
        n = sum(lengths)
        gen = torch.Generator().manual_seed(span + 1)
        q_tok, k_tok, v_tok = (torch.randn(n, h, D, generator=gen).to(device, torch.bfloat16) for h in (H, G, G))
        seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
        pos = torch.cat([torch.arange(x) for x in lengths]).to(device)
        packed = attention._token_layout(q_tok, k_tok, v_tok, seq, pos, len(lengths), span, D ** -0.5, None)
        tokens = sorted({t for t in (0, 63, 64, span - 1, span, span + 5, n - 1) if t < n})
        got, want = [], []
        for token in tokens:
            p = int(pos[token])
            first = token - p
            cache_k = torch.full((1, G, span, D), float("nan"), device=device, dtype=torch.bfloat16)
            cache_v = cache_k.clone()
            cache_k[0, :, : p + 1] = k_tok[first : token + 1].transpose(0, 1)
            cache_v[0, :, : p + 1] = v_tok[first : token + 1].transpose(0, 1)
            out = attention._slot_layout(q_tok[token][None, :, None], cache_k, cache_v, pos[token].view(1, 1), span,
                                         D ** -0.5, None)
            got.append(out[0, 0])
            want.append(packed[token])
        _case(rows, "attention", "layouts: packed trainer vs engine decode", torch.bfloat16, torch.stack(got),
              torch.stack(want), span=span, tokens=len(tokens))
    return rows


# ---------------------------------------------------------------- log-prob


def check_logprob(torch, device, vocab, m_list, dtypes) -> list[dict]:
    from verl_async.invariant import triton_softmax

    rows: list[dict] = []
    for dtype in dtypes:
        ms = m_list if dtype == torch.bfloat16 else [m for m in m_list if m <= 1024]
        top = max(ms)
        gen = torch.Generator().manual_seed(7)
        x = (torch.randn(top + CHUNK, vocab, generator=gen) * 2).to(device, dtype)
        labels = torch.randint(0, vocab, (top + CHUNK,), generator=gen).to(device)
        for temperature in (1.0, 0.7):
            full_logp, full_ent = triton_softmax.token_logprobs(x, labels, temperature, with_entropy=True)
            for m in ms:
                for s in sorted({0, CHUNK % (top + CHUNK - m + 1), top + CHUNK - m}):
                    xs, ls = x[s : s + m], labels[s : s + m]
                    logp, ent = triton_softmax.token_logprobs(xs, ls, temperature, with_entropy=True)
                    info = {"rows": m, "offset": s, "temperature": temperature}
                    _case(rows, "logprob", "log-prob", dtype, logp, full_logp[s : s + m], **info)
                    _case(rows, "logprob", "entropy", dtype, ent, full_ent[s : s + m], **info)
                    _case(rows, "logprob", "log-prob without the entropy", dtype,
                          triton_softmax.token_logprobs(xs, ls, temperature), full_logp[s : s + m], **info)
                    if m <= 1024 and dtype != torch.float32:
                        _case(rows, "logprob", "log-prob from float32 logits (the engine's call)", dtype,
                              triton_softmax.token_logprobs(xs.float(), ls, temperature), full_logp[s : s + m], **info)
                    if m <= 64 and s == 0:
                        _case(rows, "logprob", "log-prob, logits 2 bytes off alignment", dtype,
                              triton_softmax.token_logprobs(_misaligned(torch, xs), ls, temperature),
                              full_logp[s : s + m], **info)
        del x
    return rows


# ---------------------------------------------------------------- price


def bench_attention(torch, device, shape, spans, decode, train_tokens, reps) -> list[dict]:
    import torch.nn.functional as F

    from verl_async.invariant import attention, triton_ops, triton_softmax

    D = shape["head_dim"]
    scale = D ** -0.5
    out = []

    def chunked(q, k, v, pos):
        os.environ[triton_ops.USE_ENV] = "0"  # the fixed-tile path, as VERL_ASYNC_INVARIANT_TRITON=0 runs it
        try:
            return attention._attend(q, k, v, pos, scale, None, 32, k.shape[2])
        finally:
            os.environ.pop(triton_ops.USE_ENV)

    for L in spans:
        for B in decode:
            q, k, v = _trainer_qkv(torch, device, shape, B, L, torch.bfloat16, seed=B)
            qd = q[:, :, :, -1:].contiguous()
            pos = torch.full((B, 1), L - 1, device=device)
            times = {"torch": _time(torch, lambda: F.scaled_dot_product_attention(
                         qd.reshape(B, -1, 1, D), k, v, scale=scale, enable_gqa=True), reps),
                     "chunked": _time(torch, lambda: chunked(qd, k, v, pos), reps),
                     "triton": _time(torch, lambda: triton_softmax.attention_forward(qd, k, v, pos, scale), reps)}
            out.append({"op": f"attention decode, span {L}", "rows": B, **{f"{p}_s": t for p, t in times.items()},
                        **{f"{p}_tok_s": B / t for p, t in times.items()}})
        S = max(1, train_tokens // L)
        q, k, v = _trainer_qkv(torch, device, shape, S, L, torch.bfloat16, seed=L)
        qc = q.contiguous()
        pos = torch.arange(L, device=device).expand(S, L)
        times = {"torch": _time(torch, lambda: F.scaled_dot_product_attention(
                     qc.reshape(S, -1, L, D), k, v, is_causal=True, scale=scale, enable_gqa=True), reps),
                 "chunked": _time(torch, lambda: chunked(q, k, v, pos), max(1, reps // 4)),
                 "triton": _time(torch, lambda: triton_softmax.attention_forward(q, k, v, pos, scale), reps)}
        out.append({"op": f"attention training, span {L}", "rows": S * L, **{f"{p}_s": t for p, t in times.items()},
                    **{f"{p}_tok_s": S * L / t for p, t in times.items()}})
        del q, k, v, qc
    return out


ATTN_TILES = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2),
              (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3)]


def attention_sweep(torch, device, shape, L, train_tokens, reps) -> list[dict]:
    """Each candidate AttentionConfig (BLOCK_M, BLOCK_N, warps, stages): is it invariant (a decode batch's rows at
    other positions, the cache NaN past each, against the trainer's call of whole sequences, bf16), and its seconds
    per call for the training call (causal, `train_tokens` query tokens of span-long sequences) and a decode batch of
    64 rows at the last position. A config changes the bits of engine and trainer alike: any invariant one may
    serve (VERL_ASYNC_INVARIANT_ATTN_TILE, triton_softmax.attention_config)."""
    import torch.nn.functional as F

    from verl_async.invariant import triton_softmax

    D = shape["head_dim"]
    scale = D ** -0.5
    S = max(1, train_tokens // L)
    q, k, v = _trainer_qkv(torch, device, shape, S, L, torch.bfloat16, seed=11)
    pos = torch.arange(L, device=device).expand(S, L)
    at = torch.tensor([min(L - 1, p) for p in (0, 63, 64, L // 2 + 5, L - 1)] * S, device=device)[:S]
    q_dec = torch.stack([q[s, :, :, int(at[s])] for s in range(S)])[:, :, :, None].contiguous()
    k_nan, v_nan = k.clone(), v.clone()
    for s in range(S):
        k_nan[s, :, int(at[s]) + 1:], v_nan[s, :, int(at[s]) + 1:] = float("nan"), float("nan")
    B = 64
    qd, kd, vd = (t[:1].expand(B, *t.shape[1:]).contiguous() for t in (q[:, :, :, -1:], k, v))
    posd = torch.full((B, 1), L - 1, device=device)
    qc = q.contiguous()
    out = [{"tile": "torch (SDPA)",
            "train_s": _time(torch, lambda: F.scaled_dot_product_attention(
                qc.reshape(S, -1, L, D), k, v, is_causal=True, scale=scale, enable_gqa=True), reps),
            "decode64_s": _time(torch, lambda: F.scaled_dot_product_attention(
                qd.reshape(B, -1, 1, D), kd, vd, scale=scale, enable_gqa=True), reps)}]
    for tile in ATTN_TILES:
        cfg = triton_softmax.AttentionConfig(*tile)
        trained = triton_softmax.attention_forward(q, k, v, pos, scale, None, cfg)
        decoded = triton_softmax.attention_forward(q_dec, k_nan, v_nan, at[:, None], scale, None, cfg)
        want = torch.stack([trained[s, :, :, int(at[s])] for s in range(S)])
        row = {"tile": ",".join(map(str, tile)), "invariant": bool(torch.equal(decoded[:, :, :, 0], want))}
        row["train_s"] = _time(torch, lambda: triton_softmax.attention_forward(q, k, v, pos, scale, None, cfg), reps)
        row["decode64_s"] = _time(torch, lambda: triton_softmax.attention_forward(qd, kd, vd, posd, scale, None, cfg),
                                  reps)
        out.append(row)
    return out


def bench_logprob(torch, device, vocab, m_list, reps) -> list[dict]:
    from verl_async.algos.logprob import logprobs_and_entropy, logprobs_from_logits
    from verl_async.invariant import triton_softmax

    out = []
    temperature = 1.0
    gen = torch.Generator().manual_seed(8)
    for m in m_list:
        x = (torch.randn(m, vocab, generator=gen) * 2).to(device, torch.bfloat16)
        labels = torch.randint(0, vocab, (m,), generator=gen).to(device)
        times = {
            "torch": _time(torch, lambda: torch.log_softmax(x.float() / temperature, -1).gather(-1, labels[:, None]),
                           reps),
            "mode_off": _time(torch, lambda: logprobs_from_logits(x, labels, temperature), reps),
            "chunked": _time(torch, lambda: logprobs_from_logits(x, labels, temperature, 64, fixed_chunks=True), reps),
            "triton": _time(torch, lambda: triton_softmax.token_logprobs(x, labels, temperature), reps),
        }
        if m <= 64:
            xf = x.float()
            times["triton_fp32_in"] = _time(torch, lambda: triton_softmax.token_logprobs(xf, labels, temperature),
                                            reps)
        out.append({"op": "log-prob", "rows": m, **{f"{p}_s": t for p, t in times.items()},
                    **{f"{p}_tok_s": m / t for p, t in times.items()}})
        times = {
            "mode_off": _time(torch, lambda: logprobs_and_entropy(x, labels, temperature), reps),
            "chunked": _time(torch, lambda: logprobs_and_entropy(x, labels, temperature, 64, fixed_chunks=True), reps),
            "triton": _time(torch, lambda: triton_softmax.token_logprobs(x, labels, temperature, with_entropy=True),
                            reps),
        }
        out.append({"op": "log-prob + entropy", "rows": m, **{f"{p}_s": t for p, t in times.items()},
                    **{f"{p}_tok_s": m / t for p, t in times.items()}})
        del x
    return out


def _ratios(rows: list[dict]) -> list[dict]:
    for r in rows:
        base = r.get("torch_tok_s") or r.get("mode_off_tok_s")
        if base:
            r["triton_vs_torch"] = r["triton_tok_s"] / base
        if r.get("mode_off_tok_s"):
            r["triton_vs_mode_off"] = r["triton_tok_s"] / r["mode_off_tok_s"]
        r["triton_vs_chunked"] = r["triton_tok_s"] / r["chunked_tok_s"]
    return rows


def main(argv=None) -> int:
    args = _args(argv)
    from verl_async.invariant.shapes import PROCESS_ENV

    os.environ.update(PROCESS_ENV)  # read when cuBLAS starts: the chunked path's GEMMs run as a mode worker's do
    torch, device = torch_and_device(args.smoke)
    try:
        import triton
    except ImportError as e:
        sys.exit(f"triton is not importable: {e}")
    if device.type == "cpu":  # the interpreter stands in for CUDA: take the Triton path in the layouts too
        from verl_async.invariant import triton_ops

        triton_ops.use_triton = lambda d: os.environ.get(triton_ops.USE_ENV, "1") != "0"
    shape = TINY if args.smoke else QWEN05
    spans = [int(x) for x in args.spans.split(",")]
    decode = [int(x) for x in args.decode.split(",")]
    m_list = [int(x) for x in args.rows.split(",")]
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                    "torch": torch.__version__, "triton": triton.__version__, "shape": shape, "spans": spans}

    if args.attn_sweep:
        rows = attention_sweep(torch, device, shape, spans[0], args.train_tokens, args.reps)
        report["attention_sweep"] = rows
        print(f"attention tiles, span {spans[0]}, {args.train_tokens} training query tokens (BLOCK_M,BLOCK_N,warps,"
              f"stages; set one with VERL_ASYNC_INVARIANT_ATTN_TILE):")
        for r in rows:
            print(f"  {r['tile']:<14} invariant {str(r.get('invariant', '-')):<5} training {r['train_s'] * 1e3:8.2f} ms"
                  f"   decode x64 {r['decode64_s'] * 1e6:8.1f} us")
        write_report(report, args.out, "invariant_attention_sweep.json")
        return 1 if any(r.get("invariant") is False for r in rows) else 0

    t0 = time.perf_counter()
    inv = check_attention(torch, device, shape, spans, decode, [torch.bfloat16, torch.float32], args.check_tokens)
    inv += check_logprob(torch, device, shape["vocab"], m_list, [torch.bfloat16, torch.float32])
    bad = [r for r in inv if not r["equal"]]
    report["invariance"] = inv
    for op in ("attention", "logprob"):
        mine = [r for r in inv if r["op"] == op and not r["case"].startswith("vs SDPA")]
        print(f"invariance, {op}: {sum(r['equal'] for r in mine)}/{len(mine)} cases bitwise equal")
    for r in inv:
        if r["case"].startswith("vs SDPA"):
            print(f"  attention {r['dtype']} span {r['span']}: max |triton - SDPA| = {r['max_abs_diff']:.3g}")
    for r in bad:
        print(f"  NOT EQUAL: {r}")
    print(f"({time.perf_counter() - t0:.1f} s)")

    if not args.skip_bench:
        table = _ratios(bench_attention(torch, device, shape, spans, decode, args.train_tokens, args.reps)
                        + bench_logprob(torch, device, shape["vocab"], m_list, args.reps))
        report["price"] = table
        print(f"\n{'op':<30}{'rows':>7}{'torch tok/s':>14}{'mode-off':>14}{'chunked':>14}{'triton':>14}"
              f"{'tri/torch':>10}{'tri/off':>9}{'tri/chunk':>10}")
        for r in table:
            print(f"{r['op']:<30}{r['rows']:>7}{r.get('torch_tok_s', 0):>14,.0f}{r.get('mode_off_tok_s', 0):>14,.0f}"
                  f"{r['chunked_tok_s']:>14,.0f}{r['triton_tok_s']:>14,.0f}{r.get('triton_vs_torch', 0):>10.2f}"
                  f"{r.get('triton_vs_mode_off', 0):>9.2f}{r['triton_vs_chunked']:>10.2f}")

    write_report(report, args.out, "invariant_triton_softmax.json")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
