"""Validations that run beside training (`trainer.val_async=true`), one at a time, each on one version.

The Trainer starts a validation right after the sync that made version v (generation has
resumed); its requests share the engines with the training rollouts while the trainer goes on
training. Its metrics belong to version v and are logged at the step of version v whenever they
arrive (`take`, polled by the trainer every step).

A validation never sees two versions: training requests are aborted at a sync (partial rollout)
and continued under the new weights, validation requests are not. The next sync therefore waits
for the validation still running (`settle`) before it moves weights — generation is paused by
then, so the validation has the engines to itself and finishes sooner. verl's fully async
recipe makes the same choice (its next sync waits for the last validation). A validation that
fails or passes `trainer.val_timeout_s` (the Validator's own deadline) is an outcome too: it is
logged as failed and the run goes on; one whose reward function fails too often is `fatal`
(reward_model.max_error_rate), and the trainer stops the run with it, as in training.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, Optional

from verl_async.errors import innermost_cause
from verl_async.reward.error_rate import RewardFunctionError


@dataclass(frozen=True)
class ValidationOutcome:
    """One finished validation: `metrics` (val/*, maybe the logged generations) or `error`."""

    version: int
    metrics: Optional[dict[str, Any]]
    error: Optional[str]
    fatal: bool  # the reward function failed too often: the run stops
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class BackgroundValidation:
    """Runs `validate(version)` as a task of the running event loop; keeps outcomes until taken."""

    def __init__(self, validate: Callable[[int], Awaitable[dict[str, Any]]]) -> None:
        self._validate = validate
        self._task: Optional[asyncio.Task] = None
        self._version: Optional[int] = None
        self._done: list[ValidationOutcome] = []

    @property
    def running_version(self) -> Optional[int]:
        """The version being validated now (None: none is)."""
        return self._version if self._task is not None and not self._task.done() else None

    def start(self, version: int) -> None:
        """Start validating `version`; the one before must have been settled (a sync settles it)."""
        if self.running_version is not None:
            raise RuntimeError(f"validation of version {version} started while version {self._version} still runs "
                               f"(a sync settles it first)")
        self._version = int(version)
        self._task = asyncio.get_running_loop().create_task(self._run(int(version)), name=f"validation-{version}")

    async def _run(self, version: int) -> None:
        t0 = time.monotonic()
        try:
            metrics = await self._validate(version)
        except Exception as exc:  # noqa: BLE001 - every failure is an outcome the trainer logs
            cause = innermost_cause(exc)
            self._done.append(ValidationOutcome(version, None, f"{type(cause).__name__}: {cause}",
                                                isinstance(cause, RewardFunctionError), time.monotonic() - t0))
            return
        self._done.append(ValidationOutcome(version, metrics, None, False, time.monotonic() - t0))

    async def settle(self) -> list[ValidationOutcome]:
        """Wait for the running validation (bounded by its own timeout); then every outcome not yet taken."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait([task])
        return self.take()

    async def cancel(self) -> Optional[int]:
        """Stop the running validation, without an outcome (the caller reports it); its version, None when none ran."""
        version, task = self.running_version, self._task
        if version is None or task is None:
            return None
        task.cancel()
        await asyncio.wait([task])
        return version

    def take(self) -> list[ValidationOutcome]:
        """The outcomes finished since the last take, oldest first."""
        out, self._done = self._done, []
        return out
