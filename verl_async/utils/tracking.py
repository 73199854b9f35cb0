"""Metrics and validation generations to the loggers of `trainer.logger` (verl's names).

Step = parameter version, as verl's fully-async recipe logs it. Only numbers are logged
as metrics; anything else in a metrics dict is ignored so a stray string never kills a
run. Backends (verl_async/utils/tracking_backends.py): console, tensorboard, wandb,
mlflow, swanlab and file (JSONL). verl's other backends are refused by validation, and
a backend whose package is missing by the preflight (`missing_packages`), each in one
line: a logger is never dropped silently.

`trainer.log_val_generations=N` (verl): validation picks N of its samples with
`val_generations` (verl's choice: sorted by input text, shuffled with seed 42, the
first N) and hands them back under VAL_GENERATIONS_KEY; the trainer gives them to
`Tracker.log_generations`.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
from typing import Any, Iterable, List, Mapping, Optional, Sequence

SUPPORTED_LOGGERS = ("console", "tensorboard", "wandb", "mlflow", "swanlab", "file")
# verl 0.9's other backends (verl/utils/tracking.py): refused by name, not as unknown
VERL_ONLY_LOGGERS = ("vemlp_wandb", "clearml", "trackio", "rl_insight")
# the package each backend imports (console and file need none)
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab"}
VAL_GENERATIONS_KEY = "val/generations"
VAL_GENERATIONS_SEED = 42  # verl's RandomState seed


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


# --------------------------------------------------------------------------- validation generations
def val_sample_order(inputs: Sequence[str], n: int) -> List[int]:
    """Indices of the `n` samples verl logs (RayPPOTrainer._maybe_log_val_generations).

    verl sorts the (input, output, score) samples by input text (a stable sort), shuffles
    them with numpy's RandomState(42) and keeps the first n; shuffling the sorted indices
    with the same generator permutes the same positions.
    """
    import numpy as np

    order = sorted(range(len(inputs)), key=inputs.__getitem__)
    np.random.RandomState(VAL_GENERATIONS_SEED).shuffle(order)
    return order[: max(0, int(n))]


def val_generations(tokenizer: Any, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                    scores: Sequence[float], n: int) -> List[dict]:
    """The `n` samples to log as plain dicts {input, output, score} (they cross Ray); texts without special tokens.

    One entry per scored response (a prompt with k samples is k entries), as in verl. Only
    the chosen responses are decoded.
    """
    if not (len(prompt_ids) == len(response_ids) == len(scores)):
        raise ValueError(f"val_generations: {len(prompt_ids)} prompts, {len(response_ids)} responses, "
                         f"{len(scores)} scores")
    inputs = tokenizer.batch_decode([list(p) for p in prompt_ids], skip_special_tokens=True)
    chosen = val_sample_order(inputs, n)
    outputs = tokenizer.batch_decode([list(response_ids[i]) for i in chosen], skip_special_tokens=True)
    return [{"input": inputs[i], "output": out, "score": float(scores[i])} for i, out in zip(chosen, outputs)]


def format_val_generations(samples: Sequence[Mapping[str, Any]], step: int, max_chars: Optional[int] = None) -> str:
    """verl's TensorBoard text of the samples (Markdown); `max_chars` shortens each text (the console)."""

    def cut(text: Any) -> str:
        text = str(text)
        if max_chars is None or len(text) <= max_chars:
            return text
        return f"{text[:max_chars]}... ({len(text) - max_chars} more characters)"

    parts = [f"**Generation Results - Step {step}**\n\n"]
    for i, s in enumerate(samples):
        parts.append(f"### Sample {i + 1}\n**Input:** {cut(s['input'])}\n\n**Output:** {cut(s['output'])}\n\n"
                     f"**Score:** {s['score']}\n\n---\n\n")
    return "".join(parts)


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
                               console_keys=frozenset(console_keys))
        self.backends = [backends.BACKENDS[name](run) for name in dict.fromkeys(self.loggers)]

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        values = numeric(metrics)
        finite = {k: v for k, v in values.items() if math.isfinite(v)}
        for backend in self.backends:
            backend.log(values, finite, step)

    def log_generations(self, samples: Sequence[Mapping[str, Any]], step: int) -> None:
        """Validation samples {input, output, score} at `step` (trainer.log_val_generations)."""
        if not samples:
            return
        for backend in self.backends:
            backend.log_generations(list(samples), step)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
