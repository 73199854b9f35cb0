"""Run one piece of model-written Python code in the sandbox and collect what it did.

    result = await run_code("print(6 * 7)", SandboxLimits(wall_time_s=5))
    result.stdout, result.exit_code, result.timed_out, result.message()

`limits.isolation`:

* `nsjail` (the default): the OS sandbox of jail.py. Where it cannot be set up,
  `isolation_problem()` says why in one line (the tools refuse to start with it).
* `process`: NO OS isolation, an explicit opt-in for machines without namespaces: a fresh
  `python -I -S -B` process in a new session and a private temporary folder, with the same
  rlimits, a scrubbed environment and its process group killed at the end. The code runs as
  the caller's user, sees the caller's files and network, and can signal its processes.

Never raises for anything the code does; a sandbox that fails to start is
`SandboxResult.sandbox_error`. Cancelling the call kills the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import time
from typing import Optional, Union

from verl_async.sandbox.jail import (CGROUP_PARENT, CGROUP_V1, SUPERVISOR, IsolationUnavailable, jail_plan,
                                     supervisor_args)
from verl_async.sandbox.limits import SandboxLimits, SandboxResult

MODES = ("notebook", "script")
DRAIN_S = 1.0  # after the run ended: how long its output pipes may take to reach their end
STOP_S = 3.0  # after SIGTERM: how long nsjail may take to kill the jail and clean up


def isolation_problem(limits: SandboxLimits = SandboxLimits()) -> Optional[str]:
    """None when `limits` can run here; else one line: what is missing and how to get it."""
    if limits.isolation != "nsjail":
        return None
    try:
        jail_plan(limits.interpreter, limits.allow_site_packages)
    except IsolationUnavailable as exc:
        return str(exc)
    return None


async def _read_capped(stream: asyncio.StreamReader, cap: int, into: bytearray, full: asyncio.Event) -> None:
    """Read to the end, keeping at most `cap` bytes; set `full` when there was more."""
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return
        room = cap - len(into)
        into += chunk[: max(0, room)]
        if len(chunk) > room:
            full.set()
            return


async def _pipe_reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader, transport


def _write_all(fd: int, data: bytes) -> None:
    """Blocking write of the code (in a thread): the supervisor reads it first; if the sandbox never
    started, the pipe's last reader closes with nsjail and the write ends with EPIPE."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass
    finally:
        os.close(fd)


async def _feed_stdin(stream: Optional[asyncio.StreamWriter], data: bytes) -> None:
    if stream is None:
        return
    try:
        if data:
            stream.write(data)
            await stream.drain()
        stream.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


def _sweep_cgroups() -> None:
    """Remove the per-run cgroups nsjail left when it was killed (their process is gone)."""
    for controller in ("pids", "memory"):
        parent = os.path.join(CGROUP_V1, controller, CGROUP_PARENT)
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if name.startswith("NSJAIL.") and not os.path.exists(f"/proc/{name.split('.', 1)[1]}"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(parent, name))


async def _stop(proc: asyncio.subprocess.Process, jailed: bool) -> None:
    """End the run: nsjail kills its jail on SIGTERM (and cleans its cgroups); the process mode's group is killed."""
    if proc.returncode is not None:
        return
    if jailed:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=STOP_S)
            return
        except asyncio.TimeoutError:
            pass
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # the jail's first process has PR_SET_PDEATHSIG=SIGKILL: it dies, and its namespace
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), timeout=STOP_S)
        _sweep_cgroups()
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), timeout=STOP_S)


def _hard_kill(proc: asyncio.subprocess.Process, jailed: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if jailed:
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGKILL)


async def run_code(code: str, limits: SandboxLimits = SandboxLimits(), *, stdin: Union[str, bytes, None] = None,
                   mode: str = "notebook", merge_stderr: bool = True) -> SandboxResult:
    """Run `code` under `limits` (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"run_code mode={mode!r}: expected one of {MODES}")
    jailed = limits.isolation == "nsjail"
    read_code, write_code = os.pipe()
    read_status, write_status = os.pipe()
    workdir = None
    try:
        if jailed:
            plan = jail_plan(limits.interpreter, limits.allow_site_packages)
            args = supervisor_args(limits, read_code, write_status, True, mode, plan.sys_path)
            argv, env, cwd, session = plan.argv(limits, SUPERVISOR, args, (read_code, write_status)), {}, None, False
        else:
            workdir = tempfile.mkdtemp(prefix="verl_async_sandbox_")
            args = supervisor_args(limits, read_code, write_status, False, mode,
                                   _process_sys_path(limits.interpreter, limits.allow_site_packages))
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
            argv, cwd, session = [limits.interpreter, "-I", "-S", "-B", "-c", SUPERVISOR, *args], workdir, True
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT if merge_stderr else asyncio.subprocess.PIPE,
            pass_fds=(read_code, write_status), env=env, cwd=cwd, start_new_session=session)
    except BaseException:
        for fd in (read_code, write_code, read_status, write_status):
            with contextlib.suppress(OSError):
                os.close(fd)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    os.close(read_code)
    os.close(write_status)
    out, err, full = bytearray(), bytearray(), asyncio.Event()
    status_bytes = b""
    timed_out = False
    tasks: list[asyncio.Future] = []
    status_transport = None
    try:
        status_reader, status_transport = await _pipe_reader(read_status)
        tasks = [asyncio.ensure_future(asyncio.to_thread(_write_all, write_code,
                                                         code.encode("utf-8", errors="replace"))),
                 asyncio.ensure_future(_feed_stdin(proc.stdin, stdin.encode("utf-8", errors="replace")
                                                   if isinstance(stdin, str) else (stdin or b""))),
                 asyncio.ensure_future(_read_capped(proc.stdout, limits.max_output_bytes, out, full))]
        if not merge_stderr:
            tasks.append(asyncio.ensure_future(_read_capped(proc.stderr, limits.max_output_bytes, err, full)))
        status_task = asyncio.ensure_future(status_reader.read())
        flood = asyncio.ensure_future(full.wait())
        done, _ = await asyncio.wait({status_task, flood}, timeout=limits.wall_time_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        flood.cancel()
        if status_task in done:
            status_bytes = status_task.result()
        else:
            status_task.cancel()
            timed_out = not full.is_set()
        duration = time.monotonic() - started
        if timed_out or full.is_set():
            await _stop(proc, jailed)
        # the run has ended (or was stopped): its pipes close; what is still unread gets a moment
        readers = [t for t in tasks[2:] if not t.done()]
        if readers:
            await asyncio.wait(readers, timeout=DRAIN_S)
        try:
            await asyncio.wait_for(proc.wait(), timeout=DRAIN_S + STOP_S)
        except asyncio.TimeoutError:
            await _stop(proc, jailed)
    except BaseException:  # cancelled (the agent loop's timeout, a stop): leave nothing running
        try:
            await _stop(proc, jailed)
        except BaseException:  # noqa: BLE001 - cancelled again: the kill stands
            _hard_kill(proc, jailed)
        raise
    finally:
        for task in tasks[1:]:  # the code's writer (a thread) ends by itself when the pipe closes
            task.cancel()
        if status_transport is not None:
            status_transport.close()
        else:
            with contextlib.suppress(OSError):
                os.close(read_status)
        if not jailed:
            _hard_kill(proc, jailed)  # its children, if any escaped
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return _result(proc, status_bytes, out, err, full.is_set(), timed_out, duration)


@functools.lru_cache(maxsize=None)
def _process_sys_path(interpreter: str, allow_site_packages: bool) -> tuple[str, ...]:
    probe = "import json, sys; print(json.dumps(sys.path))"
    path = json.loads(subprocess.run([interpreter, "-I", "-S", "-c", probe], capture_output=True, text=True,
                                     check=True, timeout=60).stdout)
    if allow_site_packages:
        path += list(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
    return tuple(p for p in path if p)


def _result(proc, status_bytes: bytes, out: bytearray, err: bytearray, truncated: bool, timed_out: bool,
            duration: float) -> SandboxResult:
    stdout, stderr = out.decode("utf-8", errors="replace"), err.decode("utf-8", errors="replace")
    exit_code, signal_name, sandbox_error = None, None, None
    words = status_bytes.split()
    if len(words) == 2 and words[0] == b"exit" and words[1].lstrip(b"-").isdigit():
        exit_code = int(words[1])
        if exit_code < 0:
            try:
                signal_name = signal.Signals(-exit_code).name
            except ValueError:
                signal_name = f"signal {-exit_code}"
    elif not (timed_out or truncated):
        # no status from inside: the sandbox did not start, or its supervisor was killed (memory)
        sandbox_error = f"it ended without a result (exit code {proc.returncode})"
        lines = [line for line in (stderr or stdout).splitlines() if line.startswith(("[E]", "[F]"))]
        if lines:
            sandbox_error += f": {lines[0][:300]}"
            stdout, stderr = "", ""
    if timed_out or truncated:
        exit_code = None
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, timed_out=timed_out, truncated=truncated,
                         signal_name=None if (timed_out or truncated) else signal_name, duration_s=duration,
                         sandbox_error=sandbox_error)
