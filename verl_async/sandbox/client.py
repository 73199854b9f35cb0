"""Calling a SandboxFusion service (or the built-in server) as verl does.

verl's `call_sandbox_api` (verl/utils/reward_score/sandbox_fusion/utils.py): POST the payload
of `fusion.request_payload`, a request timeout of compile + run + 10 s, up to 3 tries on
HTTP 504 (1 s, then 2 s apart), any other failure at once. Both return
`(response JSON, None)` or `(None, error)`: a service that fails is an answer, never an
exception.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from verl_async.sandbox.fusion import request_payload

API_TIMEOUT_S = 10.0
MAX_RETRIES = 3
RETRY_DELAY_S = 1.0


async def call_run_code(url: str, code: str, *, stdin: Optional[str] = None, run_timeout: float = 10.0,
                        compile_timeout: Optional[float] = None, memory_limit_mb: int = 1024,
                        language: str = "python") -> tuple[Optional[dict], Optional[str]]:
    import aiohttp

    compile_timeout = run_timeout if compile_timeout is None else compile_timeout
    payload = request_payload(code, stdin=stdin, run_timeout=run_timeout, compile_timeout=compile_timeout,
                              memory_limit_mb=memory_limit_mb, language=language)
    timeout = aiohttp.ClientTimeout(total=compile_timeout + run_timeout + API_TIMEOUT_S)
    error = None
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for attempt in range(MAX_RETRIES):
            try:
                async with session.post(url, json=payload, headers={"Accept": "application/json"}) as response:
                    if response.status == 504:
                        error = f"Gateway Timeout (504) on attempt {attempt + 1}/{MAX_RETRIES}"
                        if attempt < MAX_RETRIES - 1:
                            await asyncio.sleep(RETRY_DELAY_S * (attempt + 1))
                        continue
                    if response.status >= 400:
                        return None, f"HTTP {response.status} from {url}: {(await response.text())[:300]}"
                    return await response.json(content_type=None), None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                return None, f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
    return None, error


def call_run_code_sync(url: str, code: str, *, stdin: Optional[str] = None, run_timeout: float = 10.0,
                       compile_timeout: Optional[float] = None, memory_limit_mb: int = 1024,
                       language: str = "python") -> tuple[Optional[dict], Optional[str]]:
    import requests

    compile_timeout = run_timeout if compile_timeout is None else compile_timeout
    payload = request_payload(code, stdin=stdin, run_timeout=run_timeout, compile_timeout=compile_timeout,
                              memory_limit_mb=memory_limit_mb, language=language)
    error = None
    for attempt in range(MAX_RETRIES):
        try:
            response = requests.post(url, json=payload, headers={"Accept": "application/json"},
                                     timeout=compile_timeout + run_timeout + API_TIMEOUT_S)
        except requests.RequestException as exc:
            return None, f"{type(exc).__name__}: {exc}"[:300]
        if response.status_code == 504:
            error = f"Gateway Timeout (504) on attempt {attempt + 1}/{MAX_RETRIES}"
            if attempt < MAX_RETRIES - 1:
                time.sleep(RETRY_DELAY_S * (attempt + 1))
            continue
        if response.status_code >= 400:
            return None, f"HTTP {response.status_code} from {url}: {response.text[:300]}"
        try:
            return response.json(), None
        except ValueError as exc:
            return None, f"not a JSON answer from {url}: {exc}"
    return None, error


def service_problem(url: str, key: str, timeout_s: float = 30.0) -> Optional[str]:
    """None when `url` runs `print(6 * 7)`; else one line naming `key`, what failed and how to get a service."""
    response, error = call_run_code_sync(url, "print(6 * 7)", run_timeout=min(10.0, timeout_s))
    run = (response or {}).get("run_result") or {}
    if response is not None and response.get("status") == "Success" and (run.get("stdout") or "").strip() == "42":
        return None
    why = error or f"it answered {str(response)[:200]}"
    return (f"{key}={url}: no SandboxFusion service runs code there ({why}); start the built-in one with "
            f"`python -m verl_async.sandbox.server --port <port>` (docs/sandbox.md)")
