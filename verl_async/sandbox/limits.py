"""What one sandboxed run may use, and what it came back with."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

ISOLATIONS = ("nsjail", "process")  # process: no OS isolation, an explicit opt-in (see runner.py)


def base_interpreter() -> str:
    """The real interpreter behind this process (a venv's python is a symlink to it)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


@dataclass(frozen=True)
class SandboxLimits:
    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 1024  # address space per process, and (with cgroups) memory of the whole run
    max_output_bytes: int = 64 * 1024  # per stream
    max_file_mb: int = 16  # largest file it may write
    workdir_mb: int = 64  # its working folder (a tmpfs): all files together
    max_open_files: int = 64
    max_processes: int = 64  # the run's processes and threads, the first one included
    allow_site_packages: bool = False  # installed packages importable, read-only (numpy, sympy, ...)
    python_executable: str = ""  # "" = this interpreter (its base, outside a venv)
    isolation: str = "nsjail"

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_output_bytes", "max_file_mb", "workdir_mb",
                     "max_open_files", "max_processes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation={self.isolation!r}: expected one of {ISOLATIONS}")
        if self.max_processes < 2:
            raise ValueError("sandbox limit max_processes must be >= 2 (the run's supervisor and the code)")

    @property
    def interpreter(self) -> str:
        return os.path.realpath(self.python_executable) if self.python_executable else base_interpreter()


_SIGNAL_WHY = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed: a memory, CPU or process limit)",
               "SIGSEGV": " (crash)", "SIGXFSZ": " (file size limit)", "SIGSYS": " (forbidden system call)"}


@dataclass
class SandboxResult:
    stdout: str  # with merge_stderr: stdout and stderr as the code wrote them, interleaved
    stderr: str = ""
    exit_code: Optional[int] = None  # None: it did not end by itself (timeout, output cap, sandbox error)
    timed_out: bool = False
    truncated: bool = False
    signal_name: Optional[str] = None  # the signal that ended it, if one did
    duration_s: float = 0.0  # from the sandbox's start to its end (waiting for a slot is not in it)
    sandbox_error: Optional[str] = None  # the sandbox itself failed: the code may not have run

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.truncated or self.sandbox_error)

    def message(self) -> str:
        """What the model reads: the output, then why it failed if it did."""
        text = self.output.rstrip("\n")
        problems = []
        if self.sandbox_error:
            problems.append(f"Error: the sandbox failed ({self.sandbox_error})")
        elif self.timed_out:
            problems.append(f"Error: timed out after {self.duration_s:.1f}s; the process was killed")
        elif self.truncated:
            problems.append("Error: output limit reached; the process was killed")
        elif self.signal_name:
            problems.append(f"Error: the process ended by {self.signal_name}{_SIGNAL_WHY.get(self.signal_name, '')}")
        elif self.exit_code not in (0, None) and not text:
            problems.append(f"Error: exit code {self.exit_code}")
        parts = ([text] if text else []) + problems
        return "\n".join(parts) if parts else "(no output)"
