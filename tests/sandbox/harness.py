"""Runs model-written code through the project's own `PythonCodeTool` API, in a process of its own.

The adversarial tests call the tool as a hostile model would: with its default config, from a
process that stands for the Rollouter (this one: its parent is the test). A payload that
kills "the parent" kills this process, and the test sees it die; a token planted in this
process's environment must not come back in any answer.

    python tests/sandbox/harness.py '<json: {"codes": [...], "config": {...}}>'

prints one JSON line: {"results": [{"text", "metrics"}...], "pid": ...} and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


async def _main(spec: dict) -> list[dict]:
    from verl_async.tools.python_tool import PythonCodeTool

    tool = PythonCodeTool(dict(spec.get("config") or {}))
    results = []
    for code in spec["codes"]:
        response, _, metrics = await tool.execute("adversary", {"code": code})
        results.append({"text": response.text, "metrics": {k: v for k, v in metrics.items()
                                                           if isinstance(v, (bool, int, float, str))}})
    return results


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    results = asyncio.run(_main(spec))
    print(json.dumps({"results": results, "pid": os.getpid()}), flush=True)
