"""Run untrusted or slow scorers in worker processes with a hard time limit.

A scorer that hangs (catastrophic regex, sympy on a monster expression, a custom
function stuck in a loop) cannot be stopped from inside its own thread, so scoring
runs in `num_workers` persistent processes. A task that passes its deadline gets its
worker killed and replaced; the task reports `timed_out`. A task that raises reports
the error; a worker that dies reports it and is replaced. The fast path costs one
pipe round trip per response: workers stay up between calls.

Workers come from a `forkserver` (a clean single-threaded server process, so it is
safe inside Ray actors and threaded parents) that preloads the scorers: replacing a
killed worker is a fork, milliseconds, not a fresh interpreter. Where forkserver is
unavailable, `spawn`. A worker announces readiness before its first deadline
starts, so start-up time is never charged to a task: it imports the pool's `preload`
functions first (a custom scorer's module importing torch took 3 s; charged to the first
response, it timed out, and so did every replacement worker's first response).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Optional, Sequence

from verl_async.reward.registry import FunctionRef, to_score_dict

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0


@dataclass
class Task:
    fn: FunctionRef
    kwargs: dict[str, Any]


@dataclass
class Outcome:
    value: Optional[dict[str, float]] = None  # to_score_dict(...) of the return value
    error: Optional[str] = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.value is not None


def run_inline(task: Task) -> Outcome:
    """Call the scorer here (no time limit): for bounded scorers and for the workers themselves."""
    try:
        return Outcome(value=to_score_dict(task.fn.load()(**task.kwargs)))
    except Exception as exc:  # a scorer's bug must not stop the run
        return Outcome(error=f"{type(exc).__name__}: {exc}"[:500])


def _worker_main(conn: Connection, preload: Sequence[FunctionRef] = ()) -> None:
    import verl_async.reward.math_answer  # noqa: F401  (warm the heavy import before "ready")

    for ref in preload:
        try:
            ref.load()
        except Exception:  # noqa: BLE001 - each task that calls it reports the error
            pass
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            outcome = run_inline(task)
        except BaseException as exc:  # SystemExit & co. from user code: report, keep serving
            outcome = Outcome(error=f"{type(exc).__name__}: {exc}"[:500])
        conn.send(outcome)


_PRELOAD = ["verl_async.reward.sandbox", "verl_async.reward.registry", "verl_async.reward.math_answer"]


def _context(start_method: Optional[str]):
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Process-wide setting, read when the server starts (no effect once it runs). The
        # parent's __main__ is left out on purpose: in a Ray worker it would import ray.
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _Worker:
    def __init__(self, ctx, preload: Sequence[FunctionRef] = ()) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, tuple(preload)), daemon=True,
                                name="verl_async-scorer")
        self.proc.start()
        child.close()
        if not self.conn.poll(STARTUP_TIMEOUT_S) or self.conn.recv() != "ready":
            self.kill()
            raise RuntimeError(f"reward scorer process did not start within {STARTUP_TIMEOUT_S:.0f}s")
        self.task_index: Optional[int] = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class ScorerPool:
    """`num_workers` scorer processes; `run(tasks, timeout_s)` returns one Outcome per task.

    `preload`: functions each worker imports before it is ready (not charged to a task's time limit).
    """

    def __init__(self, num_workers: int = 1, start_method: Optional[str] = None,
                 preload: Sequence[FunctionRef] = ()) -> None:
        if num_workers < 1:
            raise ValueError(f"reward_model.num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._ctx = _context(start_method)
        self.preload = tuple(preload)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.replaced = 0  # workers killed after a timeout or found dead

    def _ensure_started(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.preload))

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.preload)
        self.replaced += 1

    def run(self, tasks: Sequence[Task], timeout_s: float) -> list[Outcome]:
        with self._lock:
            self._ensure_started()
            results: list[Optional[Outcome]] = [None] * len(tasks)
            pending = list(range(len(tasks)))[::-1]
            while pending or any(w.task_index is not None for w in self._workers):
                for worker in list(self._workers):
                    if worker.task_index is None and pending:
                        idx = pending.pop()
                        try:
                            worker.conn.send(tasks[idx])
                        except OSError:  # died while idle: replace it, the task goes back in line
                            pending.append(idx)
                            self._replace(worker)
                            continue
                        worker.task_index, worker.deadline = idx, time.monotonic() + timeout_s
                busy = [w for w in self._workers if w.task_index is not None]
                if not busy:
                    continue
                next_deadline = min(w.deadline for w in busy)
                ready = wait([w.conn for w in busy], timeout=max(0.0, next_deadline - time.monotonic()))
                for worker in busy:
                    idx = worker.task_index
                    if worker.conn in ready:
                        try:
                            results[idx] = worker.conn.recv()
                            worker.task_index = None
                            continue
                        except (EOFError, OSError):
                            code = worker.proc.exitcode
                            results[idx] = Outcome(error=f"scorer process died (exit code {code})")
                    elif time.monotonic() >= worker.deadline:
                        results[idx] = Outcome(error=f"timed out after {timeout_s:g}s", timed_out=True)
                    else:
                        continue
                    self._replace(worker)
            assert all(r is not None for r in results)
            return results  # type: ignore[return-value]

    def close(self) -> None:
        with self._lock:
            for worker in self._workers:
                try:
                    worker.conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
                worker.kill()
            self._workers.clear()

    def __del__(self) -> None:  # best effort; workers are daemons and die with us anyway
        try:
            self.close()
        except Exception:
            pass
