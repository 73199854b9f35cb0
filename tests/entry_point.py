"""`python -m recipe.fully_async_main ARGS` inside the test process: the same code path, minus a process.

A subprocess pays for a fresh interpreter, the driver's imports (torch, transformers: seconds on a
small machine) and, for a run, a Ray instance of its own (start and shutdown: ~8 s). `run_main`
calls the entry point's `cli()` here with the given argv, environment and working folder, catches
its exit, and returns what a subprocess would have: exit status, stdout, stderr. A run joins the
test session's Ray when the test asks for `ray_session` first (`pipeline.ray_init` starts none when
one is up), else it starts and stops its own as the command would.

Keep a real subprocess where the process itself is the claim: a kill or a signal, what the
interpreter imported (e.g. "a config error prints before torch loads"), an environment the command
must start without, or a crash that must not take the test process down.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import traceback
from typing import Mapping, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = ["-m", "recipe.fully_async_main"]


@contextlib.contextmanager
def _environment(env: Optional[Mapping[str, str]], cwd: Optional[str]):
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)


@contextlib.contextmanager
def _logging_restored():
    """Hydra configures the root logger for each job: give the test process its own back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)


def run_main(args: Sequence[str], *, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = REPO
             ) -> subprocess.CompletedProcess:
    """The entry point with `args` (as typed after `python -m recipe.fully_async_main`), in this process.

    `env`: the whole environment the command sees (None: this process's); `cwd`: its working folder.
    Returns a CompletedProcess as `subprocess.run(..., capture_output=True, text=True)` would.
    """
    from recipe import fully_async_main

    out, err = io.StringIO(), io.StringIO()  # Ray's and tqdm's threads write here too while the run goes
    code: object = 0
    saved_argv = sys.argv
    with _environment(env, cwd), _logging_restored(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        sys.argv = ["fully_async_main.py", *args]
        try:
            fully_async_main.cli()
        except SystemExit as exc:
            code = exc.code
            if isinstance(code, str):  # sys.exit("message"): the interpreter prints it and exits 1
                print(code, file=sys.stderr)
        except Exception:  # noqa: BLE001 - what the interpreter does with an uncaught error: traceback, exit 1
            traceback.print_exc()
            code = 1
        finally:
            sys.argv = saved_argv
    returncode = 0 if code is None else code if isinstance(code, int) else 1
    return subprocess.CompletedProcess([sys.executable, *ENTRY, *args], returncode, out.getvalue(), err.getvalue())


FRESH_ENV = "VERL_ASYNC_TEST_FRESH_PROCESS"


def ran_in_a_fresh_process(request, timeout_s: float = 900) -> bool:
    """For a test that must be its process's only Ray driver (it starts a cluster of its own and joins it): when a
    test before it in this process (this xdist worker) joined the session's Ray, run it again alone in a fresh
    interpreter and assert that it passed there; True then, and the caller returns. False: run the body here."""
    import ray

    nodeid = request.node.nodeid
    if not ray.is_initialized() or os.environ.get(FRESH_ENV) == nodeid:
        return False
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid],
                          cwd=str(request.config.rootpath), env=dict(os.environ, **{FRESH_ENV: nodeid}),
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return True
