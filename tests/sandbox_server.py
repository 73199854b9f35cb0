"""The built-in SandboxFusion server, started for tests as a user starts it (`python -m verl_async.sandbox.server`)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import requests

from verl_async.sandbox import isolation_problem

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pong(base: str) -> bool:
    try:
        return requests.get(f"{base}/v1/ping", timeout=1).json() == "pong"
    except (requests.RequestException, ValueError):
        return False


@contextlib.contextmanager
def sandbox_server(port: int, max_concurrent: int = 2) -> Iterator[str]:
    """Yields `http://127.0.0.1:<port>/run_code` while the server runs; skips (fails under CI) without a sandbox."""
    problem = isolation_problem()
    if problem and not os.environ.get("CI"):
        pytest.skip(f"no OS sandbox on this machine: {problem}")
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "verl_async.sandbox.server", "--port", str(port),
                             "--max-concurrent", str(max_concurrent)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _pong(base):
            assert proc.poll() is None, f"the server ended: {proc.stdout.read()[-2000:]}"
            assert time.monotonic() < deadline, "the server did not answer /v1/ping within 60 s"
            time.sleep(0.2)
        yield f"{base}/run_code"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
