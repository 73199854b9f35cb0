"""The trainer side heals: a dead trainer rank or Trainer actor restarts from the newest checkpoint by itself.

When `Trainer.run` ends with a process death (the Trainer actor died, a rank died or stopped
answering: `is_trainer_death`), the driver, instead of stopping the run:

1. pauses generation (a sync's pause: with partial rollout the requests in flight keep their
   tokens) and gives up on a validation still running;
2. ends the old Trainer actor and its ranks (their placement group goes with it);
3. rewinds the queue: the groups the dead trainer took since its last published checkpoint go
   back to the front (queue.py `rewind`), so every group counts exactly once against that
   checkpoint; the Rollouter and its cursor, prompts in flight and engines live on;
4. starts a new Trainer actor (new ranks, new placement), loads that checkpoint (or the model as
   the run started, when none was written yet) and pushes its weights: the engines and the
   Rollouter go back to its version, and generation resumes.

The run's step count and the groups it trains then equal an uninterrupted run's. At most
`trainer.max_restarts` times per run (a death after that ends the run as before). Needs
checkpoints (`trainer.save_freq` > 0) to lose little; without them a restart retrains from the
start. What does not heal: the driver, the queue actor, the Rollouter actor, the head node.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import ray

from verl_async.errors import root_cause

logger = logging.getLogger("verl_async")


def is_trainer_death(exc: BaseException) -> bool:
    """Whether a failure of `Trainer.run` is a process death the trainer side heals from (not a bug or a bad input).

    Deaths: Ray's actor errors (the Trainer actor or a rank died or is unreachable), a worker group that lost a
    rank or waited for one past `trainer.worker_timeout_s` (WorkerGroupError), a weight sync that failed because a
    member died. An exception raised by the code itself (a ValueError in the loss, a deadlock) is not one.
    """
    seen: set[int] = set()
    stack = [exc]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError)):
            return True
        if type(err).__name__ == "WorkerGroupError" or any(c.__name__ == "WorkerGroupError" for c in type(err).__mro__):
            return True
        stack += [getattr(err, "cause", None), err.__cause__]
    return False


def brief(text: str, limit: int = 300) -> str:
    """The first line of an error (Ray's actor errors go on with the actor's id, pid and troubleshooting text)."""
    first = text.strip().splitlines()[0] if text.strip() else text
    return first if len(first) <= limit else first[:limit] + "..."


@dataclass
class TrainerRestart:
    restart: int
    cause: str
    checkpoint: Optional[str]  # what it restarted from (None: the model as the run started)
    groups_back: int  # groups the queue gave back (taken since that checkpoint)
    recovery_s: float  # death noticed -> generation resumed with the restored weights
    step: int  # the step it continued from


class TrainerSupervisor:
    """Holds the current Trainer actor; `heal(exc)` replaces a dead one (see the module docstring)."""

    def __init__(self, start: Callable[[], Any], trainer: Any, queue: Any, rollouter: Any, *, max_restarts: int,
                 timeout_s: float, sync_timeout_s: float, start_step: int = 0,
                 on_new: Optional[Callable[[Any], None]] = None) -> None:
        self._start = start  # a new Trainer actor (not yet ready)
        self.trainer = trainer
        self.queue = queue
        self.rollouter = rollouter
        self.max_restarts = int(max_restarts)
        self.timeout_s = float(timeout_s)
        self.sync_timeout_s = float(sync_timeout_s)
        self.start_step = int(start_step)
        self._on_new = on_new  # the driver keeps every actor it must end at teardown
        self.restarts: list[TrainerRestart] = []

    def heal(self, exc: BaseException) -> Optional[Any]:
        """The new Trainer actor, running, after `exc` killed the old one; None when this failure does not heal
        (not a death, restarts used up, the Rollouter gone too)."""
        if self.max_restarts <= len(self.restarts) or not is_trainer_death(exc):
            return None
        if not self._rollouter_alive():
            return None
        cause = brief(root_cause(exc))
        t0 = time.monotonic()
        print(f"warning: the trainer died ({cause}); restarting the trainer side from its newest checkpoint "
              f"(restart {len(self.restarts) + 1} of {self.max_restarts}, trainer.max_restarts)", flush=True)
        cancelled, finished = self._pause_generation()
        self._end(self.trainer)
        back = ray.get(self.queue.rewind.remote(), timeout=self.timeout_s)
        trainer = self._start()
        if self._on_new is not None:
            self._on_new(trainer)
        ray.get(trainer.progress.remote(), timeout=self.timeout_s)  # its worker group is up
        ray.get(trainer.restore_after_restart.remote(back["checkpoint"], self.start_step), timeout=self.timeout_s)
        ray.get(trainer.push_weights.remote(False), timeout=self.sync_timeout_s + self.timeout_s)
        # the validations the dead trainer had not logged: those of kept versions are logged, the one it died during
        # runs again when its version is the restored one (a heal run on two GPUs lost the validation of version 16)
        ray.get(trainer.resume_validations.remote(cancelled, finished), timeout=self.sync_timeout_s + self.timeout_s)
        step = int(ray.get(trainer.progress.remote(), timeout=self.timeout_s)["step"])
        event = TrainerRestart(len(self.restarts) + 1, cause, back["checkpoint"], int(back["groups"]),
                               round(time.monotonic() - t0, 3), step)
        self.restarts.append(event)
        ray.get(trainer.note_restart.remote(event.restart, event.recovery_s), timeout=self.timeout_s)
        where = back["checkpoint"] or "the model as the run started (no checkpoint yet)"
        print(f"healed: the trainer restarted from {where} at step {step} in {event.recovery_s:.1f} s; "
              f"{event.groups_back} group(s) it had taken since went back to the queue", flush=True)
        self.trainer = trainer
        return trainer

    def _rollouter_alive(self) -> bool:
        if self.rollouter is None:
            return True
        try:
            ray.get(self.rollouter.budget_stall.remote(), timeout=min(60.0, self.timeout_s))
            return True
        except Exception:  # noqa: BLE001 - the Rollouter is gone too: nothing to heal into
            return False

    def _pause_generation(self) -> tuple[Optional[int], list[dict[str, Any]]]:
        """Generation stops until the restored weights are on the engines. A validation still running is cancelled:
        its version, and the validations that finished without the dead trainer taking them, go to the new one."""
        if self.rollouter is None:
            return None, []
        cancelled, finished = None, []
        try:
            cancelled = ray.get(self.rollouter.cancel_validation.remote(), timeout=min(120.0, self.timeout_s))
            finished = ray.get(self.rollouter.take_validations.remote(), timeout=min(120.0, self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - the restart goes on; the next sync settles the engines
            logger.warning("cancelling the validation while the trainer restarts: %s", root_cause(exc))
        ray.get(self.rollouter.pause_for_sync.remote(), timeout=self.sync_timeout_s)
        return cancelled, finished

    @staticmethod
    def _end(trainer: Any) -> None:
        """The old Trainer actor and its ranks (their placement group is released with them)."""
        try:
            ray.get(trainer.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - dead already: Ray ends the actors it owned with it
            pass
        try:
            ray.kill(trainer)
        except Exception:  # noqa: BLE001
            pass

    def summary(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.restarts]
