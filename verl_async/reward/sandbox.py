"""Run untrusted or slow scorers in worker processes with a hard time limit.

A scorer that hangs (catastrophic regex, sympy on a monster expression, a custom
function stuck in a loop) cannot be stopped from inside its own thread, so scoring
runs in `num_workers` persistent processes. A task that passes its deadline gets its
worker killed and replaced; the task reports `timed_out`. A task that raises reports
the error; a worker that dies reports it and is replaced. The fast path costs one
pipe round trip per response: workers stay up between calls.

Workers are started with `spawn` (safe inside Ray actors and threaded parents) and
announce readiness before the first deadline starts, so their import time is never
charged to a task.
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


def _worker_main(conn: Connection) -> None:
    import verl_async.reward.math_answer  # noqa: F401  (warm the heavy import before "ready")

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


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="verl_async-scorer")
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
    """`num_workers` scorer processes; `run(tasks, timeout_s)` returns one Outcome per task."""

    def __init__(self, num_workers: int = 1, start_method: str = "spawn") -> None:
        if num_workers < 1:
            raise ValueError(f"reward_model.num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.replaced = 0  # workers killed after a timeout or found dead

    def _ensure_started(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx))

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx)
        self.replaced += 1

    def run(self, tasks: Sequence[Task], timeout_s: float) -> list[Outcome]:
        with self._lock:
            self._ensure_started()
            results: list[Optional[Outcome]] = [None] * len(tasks)
            pending = list(range(len(tasks)))[::-1]
            while pending or any(w.task_index is not None for w in self._workers):
                for worker in self._workers:
                    if worker.task_index is None and pending:
                        idx = pending.pop()
                        worker.task_index, worker.deadline = idx, time.monotonic() + timeout_s
                        worker.conn.send(tasks[idx])
                busy = [w for w in self._workers if w.task_index is not None]
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
            return [r if r is not None else Outcome(error="lost") for r in results]

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
