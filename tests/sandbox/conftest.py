"""The built-in SandboxFusion server on a free loopback port, for the tests that call it."""

from __future__ import annotations

import pytest

from tests.sandbox_server import free_port, sandbox_server


@pytest.fixture(scope="module")
def server():
    with sandbox_server(free_port()) as url:
        yield url
