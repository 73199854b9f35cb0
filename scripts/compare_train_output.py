#!/usr/bin/env python
"""Compare two `debug.save_train_output` files (slime's record-vs-train check).

    python scripts/compare_train_output.py A.pt B.pt [--atol 0] [--rtol 0]

Prints, per tensor, the max |a - b| and the first (row, token) where they differ, and
per metric both values. Exit 0 when everything agrees within the tolerances, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

import torch


def compare(a: dict, b: dict, atol: float = 0.0, rtol: float = 0.0) -> list[str]:
    problems: list[str] = []
    ta, tb = a.get("tensors", {}), b.get("tensors", {})
    for key in sorted(set(ta) | set(tb)):
        if key not in ta or key not in tb:
            problems.append(f"{key}: only in {'A' if key in ta else 'B'}")
            continue
        x, y = ta[key], tb[key]
        if x.shape != y.shape:
            problems.append(f"{key}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
            continue
        if x.dtype.is_floating_point or y.dtype.is_floating_point:
            diff = (x.double() - y.double()).abs()
            bad = diff > atol + rtol * y.double().abs()
        else:
            diff = (x != y).double()
            bad = x != y
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            problems.append(
                f"{key}: max |diff| {float(diff.max()):.3e}, first at {where}: {x[where].item()!r} vs {y[where].item()!r}"
            )
    ma, mb = a.get("metrics", {}), b.get("metrics", {})
    for key in sorted(set(ma) & set(mb)):
        if not key.startswith(("actor/", "mismatch/", "critic/")):
            continue  # timings and throughput legitimately differ
        va, vb = float(ma[key]), float(mb[key])
        if abs(va - vb) > atol + rtol * abs(vb):
            problems.append(f"metric {key}: {va!r} vs {vb!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--atol", type=float, default=0.0)
    parser.add_argument("--rtol", type=float, default=0.0)
    args = parser.parse_args(argv)
    a = torch.load(args.a, weights_only=False)
    b = torch.load(args.b, weights_only=False)
    problems = compare(a, b, args.atol, args.rtol)
    if problems:
        print(f"{len(problems)} difference(s) between {args.a} (A) and {args.b} (B):")
        for line in problems:
            print("  " + line)
        return 1
    print(f"identical within atol={args.atol} rtol={args.rtol}: {len(a.get('tensors', {}))} tensors, step {a.get('step')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
