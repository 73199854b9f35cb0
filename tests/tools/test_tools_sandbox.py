"""The Python tool's sandbox: each limit made to trip, and the run's files out of reach."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from verl_async.tools.python_tool import PythonCodeTool, extract_code
from verl_async.tools.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(wall_time_s=5.0, cpu_time_s=5, max_output_bytes=4096)


def run(code: str, limits: SandboxLimits = FAST):
    return asyncio.run(run_python(code, limits))


def test_prints_and_the_value_of_a_last_expression():
    result = run("x = 6\nprint('x is', x)\nx * 7")
    assert result.ok and result.message() == "x is 6\n42"


def test_an_exception_is_a_traceback_of_the_code_only():
    result = run("a = 1\nraise ValueError('bad value')")
    assert not result.ok and result.exit_code == 1
    assert result.message() == ('Traceback (most recent call last):\n  File "<code>", line 2, in <module>\n'
                                "ValueError: bad value")


def test_the_runs_files_cannot_be_read_or_listed(tmp_path):
    secret = tmp_path / "checkpoint.txt"
    secret.write_text("weights")
    for code in (f"open({str(secret)!r}).read()", f"import os\nos.listdir({str(tmp_path)!r})",
                 "open('/etc/hostname').read()", f"import shutil\nshutil.copyfile({str(secret)!r}, 'x')"):
        result = run(code)
        assert not result.ok and "PermissionError: sandbox: no access to" in result.message(), code
        assert "weights" not in result.message()
    assert run("import verl_async").message().endswith(".py")  # its source is in the run's folder
    assert "PermissionError: sandbox: no access to" in run("import verl_async").message()


def test_a_fresh_working_folder_that_is_deleted_afterwards():
    result = run("import os\nopen('notes.txt', 'w').write('hi')\nprint(open('notes.txt').read(), os.getcwd())")
    assert result.ok
    text, cwd = result.message().split()
    assert text == "hi" and os.path.basename(cwd).startswith("verl_async_sandbox_")
    assert not os.path.exists(cwd)
    assert run("import os\nos.listdir('.')").message() == "[]"  # nothing left from the run before


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-key")
    result = run("import os\nsorted(os.environ)")
    assert result.ok and "WANDB_API_KEY" not in result.message() and "HOME" in result.message()


@pytest.mark.parametrize("code, event", [
    ("import subprocess\nsubprocess.run(['ls'])", "subprocess.Popen"),
    ("import os\nos.system('ls')", "os.system"),
    ("import os\nos.fork()", "os.fork"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 22))", "socket."),
    ("import ctypes\nctypes.CDLL('libc.so.6')", "loading libc.so.6"),
    ("import os, signal\nos.kill(1, signal.SIGTERM)", "os.kill"),
])
def test_processes_network_and_native_code_are_refused(code, event):
    result = run(code)
    assert not result.ok and "PermissionError: sandbox:" in result.message() and event in result.message()


def test_numpy_and_the_stdlib_still_import():
    result = run("import numpy as np, fractions, statistics\nfloat(np.linalg.det(np.eye(3)) + statistics.mean([1, 3]))")
    assert result.ok and result.message() == "3.0"


def test_a_hung_snippet_is_killed_at_the_wall_clock_limit():
    t0 = time.monotonic()
    result = run("import time\nprint('started', flush=True)\ntime.sleep(60)",
                 SandboxLimits(wall_time_s=1.0, cpu_time_s=5))
    assert time.monotonic() - t0 < 5
    assert result.timed_out and not result.ok and result.exit_code is None
    assert result.message() == f"started\nError: timed out after {result.duration_s:.1f}s; the process was killed"


def test_a_busy_loop_hits_the_cpu_limit():
    result = run("while True:\n    pass", SandboxLimits(wall_time_s=20.0, cpu_time_s=1))
    assert not result.ok and not result.timed_out and result.signal_name in ("SIGXCPU", "SIGKILL")
    assert "Error: the process ended by SIG" in result.message()


def test_memory_limit_raises_memory_error():
    result = run("x = bytearray(2 * 1024**3)", SandboxLimits(wall_time_s=5.0, cpu_time_s=5, memory_mb=512))
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
        await asyncio.gather(*(tool.execute("i", {"code": "import time\ntime.sleep(0.6)"}) for _ in range(4)))
        return time.monotonic() - t0

    elapsed = asyncio.run(four())
    assert 1.2 <= elapsed < 2.4  # two at a time: two rounds of 0.6 s, not four, not one


def test_cancelling_a_run_kills_its_process_and_removes_its_folder():
    """The agent loop's tool timeout cancels the call: nothing may keep running."""
    import glob
    import tempfile

    async def go():
        task = asyncio.create_task(run_python("import os, time\nprint(os.getpid(), os.getcwd(), flush=True)\n"
                                              "time.sleep(60)", SandboxLimits(wall_time_s=30.0, cpu_time_s=30)))
        await asyncio.sleep(1.0)
        before = set(glob.glob(os.path.join(tempfile.gettempdir(), "verl_async_sandbox_*")))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return before

    before = asyncio.run(go())
    assert before, "the run had not started"
    left = set(glob.glob(os.path.join(tempfile.gettempdir(), "verl_async_sandbox_*")))
    assert not (before & left)
    time.sleep(0.2)
    for line in os.popen("ps -eo args").read().splitlines():
        assert "time.sleep(60)" not in line and "_sandbox_main" not in line
