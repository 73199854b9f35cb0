"""The code sandbox's cost: start + teardown per call, and calls at once (`rate_limit`), as a Markdown table.

    python scripts/bench_sandbox.py [--calls 40] [--json out.json]

1. Per call, `pass` run `--calls` times one after another: a fresh `python -I -S -B -c pass`
   process (the floor any process-based interpreter pays), the OS sandbox (nsjail, the default),
   and `isolation: process` (no OS isolation). p50 / p90 in milliseconds; the sandbox's own
   cost is its p50 less the fresh process's.
2. Calls at once: 16 snippets through `PythonCodeTool` with rate_limit 1, 2, 4, 8 (a
   `pass` snippet, and a ~0.25 s CPU-bound one): wall time and calls per second. On a
   2-core machine CPU-bound snippets stop scaling at 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_async.sandbox import SandboxLimits, isolation_problem, run_code  # noqa: E402
from verl_async.sandbox.limits import base_interpreter  # noqa: E402
from verl_async.tools.python_tool import PythonCodeTool  # noqa: E402

CPU_SNIPPET = "x = 0\nfor i in range(2_500_000):\n    x += i\nprint(x)"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def per_call(calls: int) -> dict[str, dict[str, float]]:
    async def fresh() -> None:
        proc = await asyncio.create_subprocess_exec(base_interpreter(), "-I", "-S", "-B", "-c", "pass",
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        await proc.communicate()

    async def sandbox(isolation: str) -> None:
        result = await run_code("pass", SandboxLimits(isolation=isolation))
        assert result.ok, result

    rows = {}
    for name, fn in (("fresh process", fresh), ("sandbox (nsjail)", lambda: sandbox("nsjail")),
                     ("isolation: process", lambda: sandbox("process"))):
        await fn()  # warm: the jail plan, page cache
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            await fn()
            times.append((time.perf_counter() - t0) * 1000)
        rows[name] = {"p50_ms": statistics.median(times), "p90_ms": pct(times, 0.9)}
    return rows


async def concurrent(snippet: str, n: int = 16) -> dict[int, dict[str, float]]:
    rows = {}
    for rate in (1, 2, 4, 8):
        tool = PythonCodeTool({"rate_limit": rate, "default_timeout": 60})
        t0 = time.perf_counter()
        results = await asyncio.gather(*(tool.execute("bench", {"code": snippet}) for _ in range(n)))
        wall = time.perf_counter() - t0
        assert all(metrics["success"] for _, _, metrics in results)
        rows[rate] = {"wall_s": wall, "calls_per_s": n / wall}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    problem = isolation_problem()
    if problem:
        sys.exit(f"no OS sandbox here: {problem}")
    single = asyncio.run(per_call(args.calls))
    light = asyncio.run(concurrent("pass"))
    heavy = asyncio.run(concurrent(CPU_SNIPPET))
    print(f"cpus: {os.cpu_count()}, calls: {args.calls}\n")
    print("| one call after another | p50 ms | p90 ms |\n|---|---|---|")
    for name, row in single.items():
        print(f"| {name} | {row['p50_ms']:.1f} | {row['p90_ms']:.1f} |")
    overhead = single["sandbox (nsjail)"]["p50_ms"] - single["fresh process"]["p50_ms"]
    print(f"\nsandbox start + teardown over a fresh process (p50): {overhead:.1f} ms\n")
    print("| rate_limit | 16 x `pass`: wall s | calls/s | 16 x CPU-bound 0.25 s: wall s | calls/s |\n|---|---|---|---|---|")
    for rate in light:
        print(f"| {rate} | {light[rate]['wall_s']:.2f} | {light[rate]['calls_per_s']:.1f} | "
              f"{heavy[rate]['wall_s']:.2f} | {heavy[rate]['calls_per_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"per_call": single, "overhead_p50_ms": overhead, "concurrent_pass": light,
                       "concurrent_cpu": heavy}, f, indent=1)


if __name__ == "__main__":
    main()
