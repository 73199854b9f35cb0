"""Metrics and validation generations to the loggers of `trainer.logger` (verl's names).

Step = the trainer's step (verl's `training/global_step`); `fully_async/param_version` is a metric
beside it, and a validation is logged at the step its weight version was made. Only numbers are logged
as metrics; anything else in a metrics dict is ignored so a stray string never kills a
run. Backends (verl_async/utils/tracking_backends.py): console, tensorboard, wandb,
mlflow, swanlab and file (JSONL). verl's other backends are refused by validation, and
a backend whose package is missing by the preflight (`missing_packages`), each in one
line: a logger is never dropped silently.

`trainer.log_val_generations=N` (verl): validation picks N samples
(verl_async/utils/val_generations.py); the trainer gives them to `Tracker.log_generations`.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence

SUPPORTED_LOGGERS = ("console", "tensorboard", "wandb", "mlflow", "swanlab", "file")
# verl 0.9's other backends (verl/utils/tracking.py): refused by name, not as unknown
VERL_ONLY_LOGGERS = ("vemlp_wandb", "clearml", "trackio", "rl_insight")
# the package each backend imports (console and file need none)
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab"}


def logger_problem(name: str) -> Optional[str]:
    """Why `name` cannot be a trainer.logger entry, or None (config-level: installed packages are not looked at)."""
    if name in SUPPORTED_LOGGERS:
        return None
    supported = ", ".join(SUPPORTED_LOGGERS)
    if name in VERL_ONLY_LOGGERS:
        return f"{name} is a verl logger that verl_async does not support; use any of: {supported}"
    return f"unknown logger {name!r}; expected any of: {supported}"


def missing_packages(names: Iterable[str]) -> List[str]:
    """`name needs package` for each logger whose package is not installed (the preflight reports the first)."""
    out = []
    for name in names:
        package = LOGGER_PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            out.append(f"{name} needs the {package} package, which is not installed: pip install {package} "
                       f"(or remove {name} from trainer.logger)")
    return out


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The entries of `metrics` that are numbers (bools, 1-element tensors included) as floats."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, numbers.Number):
            out[k] = float(v)
        elif hasattr(v, "item") and getattr(v, "numel", lambda: 0)() == 1:
            out[k] = float(v.item())
    return out


# --------------------------------------------------------------------------- the tracker
class Tracker:
    """Every backend of `loggers`, each built once; `log` and `log_generations` go to all of them."""

    def __init__(
        self,
        loggers: Iterable[str],
        log_dir: str,
        project: str = "verl_async",
        experiment: str = "run",
        config: Optional[Mapping[str, Any]] = None,
        console_keys: Iterable[str] = (),
        file_path: Optional[str] = None,
        console_sink: Optional[Callable[[str], None]] = None,
    ) -> None:
        from verl_async.utils import tracking_backends as backends

        self.loggers = [str(x) for x in loggers]
        problems = [p for p in map(logger_problem, self.loggers) if p]
        if problems:
            raise ValueError(f"trainer.logger: {problems[0]}")
        missing = missing_packages(self.loggers)
        if missing:
            raise ImportError(f"trainer.logger: {missing[0]}")
        run = backends.RunInfo(project=project, experiment=experiment, config=dict(config or {}), log_dir=log_dir,
                               file_path=file_path or os.path.join(log_dir, "metrics.jsonl"),
                               console_keys=frozenset(console_keys), console_sink=console_sink)
        self.backends = [backends.BACKENDS[name](run) for name in dict.fromkeys(self.loggers)]

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        values = numeric(metrics)
        finite = {k: v for k, v in values.items() if math.isfinite(v)}
        for backend in self.backends:
            backend.log(values, finite, step)

    def resume(self, step: int) -> None:
        """A run resumed at `step`: what a crashed process logged after it is dropped where the backend can
        (the file logger's lines, TensorBoard's events), so each step is logged once."""
        for backend in self.backends:
            if hasattr(backend, "resume"):
                backend.resume(step)

    def log_generations(self, samples: Sequence[Mapping[str, Any]], step: int) -> None:
        """Validation samples {input, output, score} at `step` (trainer.log_val_generations)."""
        if not samples:
            return
        for backend in self.backends:
            backend.log_generations(list(samples), step)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
