"""The Trainer's validations: when they are due, started beside training or run while generation waits, waited for
before a sync moves weights, logged at the step of the version they validate, and their failures (logged; a run is
never stopped by its validation, except by a broken reward function).

A mixin of `trainer.trainer.Trainer`: it reads the Trainer's `cfg`, `rollouter`, `tracker`, `timeline`, `version`,
`step`, `_version_step`, `test_freq`, `val_async`, `_call` and `_say`, and keeps the validation state
(`_val_running`, `_val_before`, `val_before`, `val_history`, `val_failures`, `_val_timeout_s`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

import ray

from verl_async.config.derived import finish_timeout_s
from verl_async.errors import innermost_cause, root_cause
from verl_async.reward.error_rate import RewardFunctionError
from verl_async.trainer.validation_handover import restart_validations
from verl_async.utils.val_generations import VAL_GENERATIONS_KEY

logger = logging.getLogger("verl_async.trainer")

# The Trainer waits this much longer than the Rollouter's own validation timeout (which fires first).
VALIDATION_GRACE_S = 120.0


def format_validation(metrics: dict[str, float]) -> str:
    """A validation's console line: its mean@k / pass@k, and the samples it lacks and why."""
    keys = [k for k in metrics if k.startswith("val/mean@") or k.startswith("val/pass@")]
    line = ", ".join(f"{k}={metrics[k]:.3f}" for k in sorted(keys))
    missing = int(metrics.get("val/missing_samples", 0))
    if missing:
        why = [f"{int(metrics.get(key, 0))} {what}" for key, what in
               (("val/failed_requests", "failed requests"), ("val/reward_errors", "failed scores"))
               if metrics.get(key, 0)]
        line += f" ({missing} of {int(metrics['val/requested_samples'])} validation samples missing: {', '.join(why)})"
    return line


class TrainerValidation:
    """Validation state and duties of the Trainer (see the module docstring)."""

    def _init_validation(self, cfg: Any) -> None:
        self.val_history: list[dict[str, float]] = []
        self.val_failures: list[dict[str, Any]] = []  # {"version", "error"}: logged, training went on
        self._val_timeout_s: Optional[float] = None  # the Rollouter's, asked once
        self.val_async = bool(cfg.trainer.get("val_async", True))
        self._val_running: Optional[int] = None  # the version validating beside training (val_async)
        self._val_before: Optional[int] = None  # the version of the validation before training that runs beside it
        self.val_before: dict[str, float] = {}  # its metrics once it ended

    def resume_validations(self, cancelled: Optional[int], finished: Sequence[dict[str, Any]]) -> None:
        """After a restart (healing/trainer.py): log what the dead trainer left (`restart_validations`), and validate
        the restored version again when its validation died with the trainer. Only a validation beside training
        (val_async) can be cancelled by a death, so the one run again is one beside training too."""
        # a cancelled validation of the restored version was due there, or was the validation before training
        due = self._validation_due() or bool(self.cfg.trainer.get("val_before_train"))
        keep, again = restart_validations(cancelled, finished, self.version, due)
        self._log_validations(keep)
        if again:
            self._start_validation()

    def _validation_due(self) -> bool:
        return self.test_freq > 0 and self.version % self.test_freq == 0 and self.version > 0

    def _start_validation(self) -> None:
        """Validate this version on the engines while training goes on (trainer.val_async)."""
        if self.rollouter is None:
            return
        if ray.get(self.rollouter.start_validation.remote(self.version), timeout=120):
            self._val_running = self.version

    def settle_validation(self) -> dict[str, float]:
        """Wait for the validation still running (generation is paused: it has the engines alone), log it.

        A sync calls this before moving weights (a validation stays on one version) and the end of the
        run before its final summary. Bounded by the validation's timeout; past it the validation is
        cancelled on the Rollouter and logged as failed.
        """
        if self._val_running is None:
            return {}
        version, start, t0 = self._val_running, self.timeline.now(), time.perf_counter()
        wait = self.timeouts()["validation_s"]
        try:
            outcomes = ray.get(self.rollouter.settle_validation.remote(), timeout=wait)
        except ray.exceptions.GetTimeoutError:
            self._val_running, outcomes = None, []
            try:  # its requests must not run on into the next version's weights
                ray.get(self.rollouter.cancel_validation.remote(), timeout=VALIDATION_GRACE_S)
            except Exception as exc:  # noqa: BLE001 - the failure below is what the run reports
                logger.warning("cancelling the validation of version %d failed: %s", version, root_cause(exc))
            self._validation_failed(f"the Rollouter did not answer within {wait:.0f} s; raise trainer.val_timeout_s",
                                    version)
        self.timeline.record("trainer/driver", "val_wait", start, self.timeline.now(), version)
        self._log_validations(outcomes)
        return {"timing_s/sync_wait_validation": time.perf_counter() - t0}

    def collect_validations(self) -> None:
        """Log the validations that finished beside training since the last step (at their own version's step)."""
        if self._val_running is not None:
            self._log_validations(ray.get(self.rollouter.take_validations.remote(), timeout=60))

    def _log_validations(self, outcomes: Sequence[dict[str, Any]]) -> None:
        for outcome in outcomes:
            if outcome["version"] == self._val_running:
                self._val_running = None
            before = outcome["version"] == self._val_before  # the validation before training, beside it
            if before:
                self._val_before = None
            if outcome["fatal"]:  # the reward function itself is broken (reward_model.max_error_rate): the run stops
                raise RewardFunctionError(outcome["error"].removeprefix(f"{RewardFunctionError.__name__}: "))
            if outcome["error"] is not None:
                self._validation_failed(outcome["error"], outcome["version"])
                if before:
                    self._say(f"warning: the validation before training (version {outcome['version']}) failed, "
                                  f"training goes on: {outcome['error']}")
            else:
                metrics = self._log_validation(dict(outcome["metrics"]), outcome["version"])
                if before and metrics:
                    self.val_before = metrics
                    self._say(f"validation before training (version {outcome['version']}): "
                                  f"{format_validation(metrics)}")

    def validate(self) -> dict[str, float]:
        """`val/*` at this version, logged; {} without validation data or when the validation failed.

        A failure (any error, or no answer within the validation timeout) is one error log
        line and an entry of `val_failures` (the end-of-run summary lists them): a run is
        never stopped by its validation. The exception is `RewardFunctionError`: the reward
        function fails too often, which stops the run whoever scored (as in training).
        """
        if self.rollouter is None:
            return {}
        wait = None
        try:
            wait = self.timeouts()["validation_s"]
            metrics = ray.get(self.rollouter.validate.remote(self.version), timeout=wait)
        except ray.exceptions.GetTimeoutError:
            within = "in time" if wait is None else f"within {wait:.0f} s"
            return self._validation_failed(f"the Rollouter did not answer {within}; raise trainer.val_timeout_s")
        except Exception as exc:  # noqa: BLE001 - whatever it was, training goes on
            if isinstance(innermost_cause(exc), RewardFunctionError):
                raise  # the reward function itself is broken (reward_model.max_error_rate): the run stops
            return self._validation_failed(root_cause(exc))
        return self._log_validation(metrics, self.version)

    def _log_validation(self, metrics: dict[str, Any], version: int) -> dict[str, float]:
        """`val/*` of `version`, logged at that version's step (however late it finished)."""
        generations = metrics.pop(VAL_GENERATIONS_KEY, None)  # trainer.log_val_generations: not a metric
        step = self._version_step.get(version, self.step)
        if metrics:
            self.val_history.append({"version": version, **metrics})
            self.tracker.log(metrics, step=step)
        if generations:
            self.tracker.log_generations(generations, step=step)
        return metrics

    def _validation_failed(self, error: str, version: Optional[int] = None) -> dict[str, float]:
        version = self.version if version is None else version
        logger.error("validation at version %d failed, training goes on: %s", version, error)
        self.val_failures.append({"version": version, "error": error})
        return {}

    def validate_before_training(self) -> tuple[dict[str, float], Optional[str]]:
        """verl's `val_before_train` while generation waits (trainer.val_async=false): (metrics, the failure for the
        driver to print, or None)."""
        failed = len(self.val_failures)
        metrics = self.validate()
        return metrics, (self.val_failures[-1]["error"] if len(self.val_failures) > failed else None)

    def start_validation_before_training(self) -> bool:
        """verl's `val_before_train` beside the first training rollouts (trainer.val_async, the default): the
        validation of this version starts on the engines and the run starts training at once instead of waiting
        for it (start-up); the first sync waits for what is left of it (a validation stays on one version). Its
        line ("validation before training (version V): ...") comes on the console when it ends. False: no
        validation data, nothing started."""
        self._start_validation()
        if self._val_running is None:
            return False
        self._val_before = self._val_running
        return True

    def timeouts(self) -> dict[str, float]:
        """How long the driver waits for a validation and for `finish()` (trainer.val_timeout_s and
        trainer.finish_timeout_s, or their derived values: config/derived.py)."""
        if self._val_timeout_s is None:
            self._val_timeout_s = 0.0 if self.rollouter is None else float(
                self._call(self.rollouter.validation_timeout_s.remote(), "the Rollouter's validation timeout"))
        validation = self._val_timeout_s + VALIDATION_GRACE_S
        # + one still running (the validation before training, too, when it runs beside training)
        before = validation if self.val_async and bool(self.cfg.trainer.get("val_before_train")) else 0.0
        at_end = before if self.test_freq <= 0 else validation * (2 if self.val_async else 1)
        return {"validation_s": validation, "finish_s": finish_timeout_s(self.cfg, at_end)}
