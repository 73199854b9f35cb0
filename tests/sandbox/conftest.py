"""The built-in SandboxFusion server on loopback, started as a user starts it, for the tests that call it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from verl_async.sandbox import isolation_problem

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    problem = isolation_problem()
    if problem and not os.environ.get("CI"):
        pytest.skip(f"no OS sandbox on this machine: {problem}")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "verl_async.sandbox.server", "--port", str(port),
                             "--max-concurrent", "2"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{base}/v1/ping", timeout=1).json() == "pong":
                break
        except requests.RequestException:
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()
    else:
        proc.kill()
        pytest.fail("the server did not answer /v1/ping within 60 s")
    yield f"{base}/run_code"
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


