"""SandboxFusion's `run_code` HTTP API served by the built-in sandbox, for verl configs that name a URL.

    python -m verl_async.sandbox.server                 # http://127.0.0.1:8080/run_code
    python -m verl_async.sandbox.server --port 9000 --max-concurrent 4

Then verl's tool config (`sandbox_fusion_url: http://localhost:8080/run_code`, ReTool's default)
and `reward.sandbox_fusion.url=http://localhost:8080/run_code` work against it. It listens on
loopback unless `--host` says otherwise (anyone who reaches it runs code in its sandbox).
Each request runs in the OS sandbox (jail.py); the server refuses to start where that
cannot be set up, unless `--isolation process` is given (no OS isolation, warned).
Endpoints: POST /run_code (fusion.py has the JSON), GET /v1/ping ("pong").
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import sys
from dataclasses import replace
from typing import Optional, Sequence

from aiohttp import web

from verl_async.sandbox.fusion import (RequestError, limits_for, parse_request, response_for, sandbox_error,
                                       unsupported)
from verl_async.sandbox.limits import ISOLATIONS, SandboxLimits
from verl_async.sandbox.runner import isolation_problem, run_code

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024  # code and stdin (test inputs can be large)


def make_app(base: SandboxLimits = SandboxLimits(), max_concurrent: int = 2) -> web.Application:
    """The aiohttp application: `max_concurrent` runs at once, the others wait their turn."""
    slots = asyncio.Semaphore(max(1, max_concurrent))
    counts = {"requests": 0, "running": 0}

    async def run(request: web.Request) -> web.Response:
        counts["requests"] += 1
        try:
            parsed = parse_request(await request.json())
        except RequestError as exc:
            return web.json_response({"detail": str(exc)}, status=422)
        except ValueError:
            return web.json_response({"detail": "body: not valid JSON"}, status=422)
        why = unsupported(parsed)
        if why:
            return web.json_response(sandbox_error(why))
        async with slots:
            counts["running"] += 1
            try:
                result = await run_code(parsed.code, limits_for(parsed, base), stdin=parsed.stdin, mode="script",
                                        merge_stderr=False)
            finally:
                counts["running"] -= 1
        return web.json_response(response_for(result))

    async def ping(request: web.Request) -> web.Response:
        return web.json_response("pong")

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/run_code", run)
    app.router.add_get("/v1/ping", ping)
    app["counts"] = counts
    return app


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verl_async.sandbox.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080: ReTool's sandbox_fusion_url)")
    p.add_argument("--max-concurrent", type=int, default=os.cpu_count() or 2,
                   help="runs at once (default: the CPU count); more requests wait")
    p.add_argument("--memory-limit-mb", type=int, default=1024, help="memory when a request sends memory_limit_MB=-1")
    p.add_argument("--max-output-bytes", type=int, default=1024 * 1024, help="stdout and stderr kept per run")
    p.add_argument("--allow-site-packages", action="store_true", help="code may import this environment's packages")
    p.add_argument("--isolation", choices=ISOLATIONS, default="nsjail",
                   help="nsjail (default): the OS sandbox; process: NO OS isolation (explicit opt-in)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    base = replace(SandboxLimits(), memory_mb=args.memory_limit_mb, max_output_bytes=args.max_output_bytes,
                   allow_site_packages=args.allow_site_packages, isolation=args.isolation)
    problem = isolation_problem(base)
    if problem:
        print(f"verl_async.sandbox.server: {problem}", file=sys.stderr)
        return 2
    if args.isolation == "process":
        logger.warning("--isolation process: requests run WITHOUT OS isolation (as this user, with its files and "
                       "network)")
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not loopback:
        logger.warning("listening on %s: anyone who reaches it runs code in this sandbox", args.host)
    logger.info("SandboxFusion run_code API on http://%s:%d/run_code (%d at once)", args.host, args.port,
                args.max_concurrent)
    web.run_app(make_app(base, args.max_concurrent), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
