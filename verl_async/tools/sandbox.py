"""Run a model's Python code in a separate, limited, killable process.

What each run gets (the README's "Multi-turn and tools" says what this does NOT protect against):

* a fresh interpreter (`python -I -B`: no PYTHON* environment, no user site, no bytecode
  written), started in a new session so the whole process group can be killed;
* a fresh private temporary folder as its working directory and HOME, deleted afterwards;
  an environment with nothing from ours but PATH;
* OS limits set in the child before the code runs: CPU seconds (RLIMIT_CPU), address
  space (RLIMIT_AS), file size (RLIMIT_FSIZE), open files, no core dumps;
* a wall-clock limit: at the deadline the process group gets SIGKILL;
* output (stdout and stderr, interleaved) capped at `max_output_bytes`: a flood is cut
  and the process killed;
* a Python audit hook (PEP 578) installed before the code runs: files may be opened for
  writing only inside the working folder and for reading only there and in the Python
  installation (stdlib, and site-packages when allowed), so the run's files (checkpoints,
  data, code, configs) cannot be read; no subprocesses, forks, exec, signals to other
  processes, sockets, ctypes, garbage-collector walks or tracing hooks.

If the code's last statement is an expression its value is printed (as in a notebook or
ReTool's interpreter), so `2**10` answers `1024`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Optional


@dataclass(frozen=True)
class SandboxLimits:
    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 1024
    max_output_bytes: int = 64 * 1024
    max_file_mb: int = 16
    max_open_files: int = 64
    allow_site_packages: bool = True  # numpy, sympy, ... importable (read-only)
    python_executable: str = sys.executable

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_output_bytes", "max_file_mb", "max_open_files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")


@dataclass
class SandboxResult:
    output: str  # stdout and stderr as the code wrote them (capped)
    exit_code: Optional[int]  # None: killed by us (timeout, output flood)
    timed_out: bool = False
    truncated: bool = False
    signal_name: Optional[str] = None  # the signal that ended it, if one did
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.truncated

    def message(self) -> str:
        """What the model reads: the output, then why it failed if it did."""
        text = self.output.rstrip("\n")
        problems = []
        if self.timed_out:
            problems.append(f"Error: timed out after {self.duration_s:.1f}s; the process was killed")
        elif self.truncated:
            problems.append("Error: output limit reached; the process was killed")
        elif self.signal_name:
            why = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed)", "SIGSEGV": " (crash)"}.get(self.signal_name, "")
            problems.append(f"Error: the process ended by {self.signal_name}{why}")
        elif self.exit_code not in (0, None) and not text:
            problems.append(f"Error: exit code {self.exit_code}")
        parts = ([text] if text else []) + problems
        return "\n".join(parts) if parts else "(no output)"


# The child's first code: limits, then the audit hook, then the model's code (read from stdin).
_BOOTSTRAP = r'''
def _sandbox_main():
    import ast, json, os, resource, sys, sysconfig
    cfg = json.loads(sys.argv[1])
    mb = 1024 * 1024
    for name, value in (("RLIMIT_CPU", cfg["cpu_time_s"]), ("RLIMIT_AS", cfg["memory_mb"] * mb),
                        ("RLIMIT_FSIZE", cfg["max_file_mb"] * mb), ("RLIMIT_NOFILE", cfg["max_open_files"]),
                        ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (int(value), int(value)))
    source = sys.stdin.read()
    sys.stdin.close()
    home = os.path.realpath(os.getcwd())
    names = ("stdlib", "platstdlib") + (("purelib", "platlib") if cfg["allow_site_packages"] else ())
    paths = sysconfig.get_paths()
    roots = tuple(sorted({os.path.realpath(p) for p in [paths[n] for n in names if n in paths] + sys.path
                          if p and os.path.exists(p) and (cfg["allow_site_packages"] or "-packages" not in p)}))
    devices = ("/dev/null", "/dev/urandom", "/dev/random", "/dev/zero")
    denied = ("subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "os.system",
              "os.kill", "os.killpg", "os.symlink", "os.link", "os.chroot", "os.setuid", "os.setgid",
              "signal.pthread_kill", "pty.", "socket.", "ctypes.dlsym", "ctypes.call_function", "ctypes.string_at",
              "ctypes.wstring_at", "ctypes.addressof", "ctypes.cdata", "ctypes.get_errno", "ctypes.set_errno", "gc.get_", "sys.settrace", "sys.setprofile",
              "sys._current_frames", "resource.setrlimit", "resource.prlimit", "webbrowser.",
              "ftplib.", "smtplib.", "urllib.", "http.", "os.startfile", "_posixsubprocess.")
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    path_events = {"os.listdir", "os.scandir", "os.chdir", "os.remove", "os.rename", "os.replace", "os.rmdir",
                   "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile",
                   "shutil.move", "glob.glob", "os.chflags", "os.mkfifo", "os.mknod"}

    def inside(path, where):
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in where)

    def hook(event, args, home=home, roots=roots, devices=devices, denied=denied):
        if event.startswith(denied):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "ctypes.dlopen" and args[0] is not None and not inside(os.path.realpath(os.fsdecode(args[0])), roots):
            raise PermissionError(f"sandbox: loading {args[0]} is not allowed")
        if event == "object.__setattr__" and args[1] == "__code__":
            raise PermissionError("sandbox: replacing a function's code is not allowed")
        if event == "open" or event in path_events:
            targets = args[:2] if event in ("os.rename", "os.replace", "shutil.copyfile", "shutil.move") else args[:1]
            for target in targets:
                if isinstance(target, int) or (target is None and event != "open"):
                    continue
                path = os.path.realpath(os.fsdecode(target)) if target is not None else home
                mode, flags = (args[1], args[2]) if event == "open" else ("w", 0)
                writing = event != "open" or (mode is not None and any(c in str(mode) for c in "wax+")) or \
                    bool((flags or 0) & writes)
                if event in ("os.listdir", "os.scandir", "glob.glob"):
                    writing = False
                if inside(path, (home,)) or (not writing and (inside(path, roots) or path in devices)):
                    continue
                raise PermissionError(f"sandbox: no access to {os.fsdecode(target)}")

    sys.addaudithook(hook)
    import traceback
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(source, "<code>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<code>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<code>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except BaseException as exc:  # the traceback without this bootstrap's frames
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != "<string>"]
        sys.stdout.flush()
        print("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
              + "".join(traceback.format_exception_only(type(exc), exc)), end="", file=sys.stderr)
        sys.exit(1)

_sandbox_main()
'''


async def _read_capped(stream: asyncio.StreamReader, cap: int, into: bytearray) -> bool:
    """Read the stream into `into`, at most `cap` bytes; True when it had more (the reader stops there).

    `into` keeps what was read when the wall-clock limit cancels the read.
    """
    seen = 0
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return False
        seen += len(chunk)
        into += chunk[: max(0, cap - len(into))]
        if seen > cap:
            return True


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the group, read its output pipe to the end, reap it (each wait at most 5 s).

    asyncio's Process.wait() returns only once the pipes are closed (Python 3.11), and a pipe
    whose reader stopped (the output cap, the wall clock) is never read to its end otherwise.
    """
    _kill_group(proc.pid)
    try:
        await asyncio.wait_for(proc.stdout.read(), timeout=5)
        await asyncio.wait_for(proc.wait(), timeout=5)
    except asyncio.TimeoutError:  # something outside the group holds the pipe: leave it
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` under `limits` (see the module docstring); never raises for anything the code does."""
    workdir = tempfile.mkdtemp(prefix="verl_async_sandbox_")
    flags = ["-I", "-B"] + ([] if limits.allow_site_packages else ["-S"])
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    started = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            limits.python_executable, *flags, "-c", _BOOTSTRAP, json.dumps(asdict(limits)),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            cwd=workdir, env=env, start_new_session=True, close_fds=True,
        )
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    timed_out = truncated = False
    output = bytearray()
    try:
        proc.stdin.write(code.encode("utf-8", errors="replace"))
        await proc.stdin.drain()
        proc.stdin.close()
        try:
            truncated = await asyncio.wait_for(_read_capped(proc.stdout, limits.max_output_bytes, output),
                                               timeout=limits.wall_time_s)
        except asyncio.TimeoutError:
            timed_out = True
        if timed_out or truncated:
            await _stop(proc)
        else:
            try:
                await asyncio.wait_for(proc.wait(), timeout=max(0.1, limits.wall_time_s - (time.monotonic() - started)))
            except asyncio.TimeoutError:  # it closed its output but ran on
                timed_out = True
                await _stop(proc)
    except (BrokenPipeError, ConnectionResetError):  # it died before reading its code
        await _stop(proc)
    except BaseException:  # cancelled (the agent loop's timeout, a stop): leave nothing running
        try:
            await _stop(proc)
        except BaseException:  # noqa: BLE001 - cancelled again: the kill stands
            _kill_group(proc.pid)
        raise
    finally:
        _kill_group(proc.pid)  # its children, if any escaped the hook
        shutil.rmtree(workdir, ignore_errors=True)
    status = proc.returncode
    signal_name = None
    if status is not None and status < 0 and not (timed_out or truncated):
        try:
            signal_name = signal.Signals(-status).name
        except ValueError:
            signal_name = f"signal {-status}"
    return SandboxResult(
        output=bytes(output).decode("utf-8", errors="replace"),
        exit_code=None if (timed_out or truncated) else status,
        timed_out=timed_out, truncated=truncated, signal_name=signal_name,
        duration_s=time.monotonic() - started,
    )
