"""Metrics to TensorBoard / console (wandb when installed and asked for).

Step = parameter version, as verl's fully-async recipe logs it. Only numbers are
logged; anything else in a metrics dict is ignored so a stray string never kills a run.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from typing import Any, Iterable, Mapping, Optional

logger = logging.getLogger("verl_async")

SUPPORTED_LOGGERS = ("console", "tensorboard", "wandb")


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, numbers.Number):
            out[k] = float(v)
        elif hasattr(v, "item") and getattr(v, "numel", lambda: 0)() == 1:
            out[k] = float(v.item())
    return out


class Tracker:
    def __init__(
        self,
        loggers: Iterable[str],
        log_dir: str,
        project: str = "verl_async",
        experiment: str = "run",
        config: Optional[Mapping[str, Any]] = None,
        console_keys: Iterable[str] = (),
    ) -> None:
        self.loggers = [str(x) for x in loggers]
        self.console_keys = set(console_keys)  # empty: print every metric
        unknown = [x for x in self.loggers if x not in SUPPORTED_LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; supported: {SUPPORTED_LOGGERS}")
        self._tb = None
        self._wandb = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(log_dir, exist_ok=True)
            self._tb = SummaryWriter(log_dir=log_dir)
        if "wandb" in self.loggers:
            try:
                import wandb
            except ImportError:
                logger.warning("trainer.logger asks for wandb but it is not installed; skipping wandb")
            else:
                self._wandb = wandb.init(project=project, name=experiment, config=dict(config or {}))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        values = _numeric(metrics)
        if self._tb is not None:
            for k, v in values.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if "console" in self.loggers:
            shown = " ".join(f"{k}={v:.4g}" for k, v in sorted(values.items()) if k in self.console_keys or not self.console_keys)
            print(f"[{step:>5}] {shown}", flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
