"""One class per `trainer.logger` backend, each importing its package only when built.

A backend takes the run's RunInfo and has `log(values, finite, step)` (all numeric
metrics, and those that are finite: TensorBoard and MLflow refuse NaN/inf),
`log_generations(samples, step)` (validation samples {input, output, score}) and
`close()`. The environment variables are verl's (verl/utils/tracking.py), so a verl
setup logs to the same places: WANDB_ENTITY, MLFLOW_TRACKING_URI / MLFLOW_RUN_ID,
SWANLAB_API_KEY / SWANLAB_LOG_DIR / SWANLAB_MODE, VERL_FILE_LOGGER_PATH.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional

from verl_async.utils.val_generations import VAL_GENERATIONS_KEY, format_val_generations

CONSOLE_TEXT_CHARS = 2000  # a validation text longer than this is shortened on the console (TensorBoard keeps it)
MLFLOW_DEFAULT_URI = "sqlite:////tmp/mlruns.db"  # verl's default when MLFLOW_TRACKING_URI is unset


@dataclass(frozen=True)
class RunInfo:
    project: str
    experiment: str
    config: Dict[str, Any]
    log_dir: str  # TensorBoard event files
    file_path: str  # the file logger's JSONL (VERL_FILE_LOGGER_PATH wins)
    console_keys: FrozenSet[str] = field(default_factory=frozenset)  # empty: print every metric
    # where console lines go (None: print). The pipeline's Trainer collects them and the driver prints them above
    # its progress bar: printed in the Trainer's actor, Ray's log forwarding glued them onto the bar's line
    console_sink: Optional[Callable[[str], None]] = None


def _print(line: str) -> None:
    print(line, flush=True)


class Console:
    def __init__(self, run: RunInfo) -> None:
        self.keys = run.console_keys
        self.emit = run.console_sink or _print

    def log(self, values: Mapping[str, float], finite: Mapping[str, float], step: int) -> None:
        shown = " ".join(f"{k}={v:.4g}" for k, v in sorted(values.items()) if not self.keys or k in self.keys)
        self.emit(f"[{step:>5}] {shown}")

    def log_generations(self, samples: List[dict], step: int) -> None:
        self.emit(format_val_generations(samples, step, max_chars=CONSOLE_TEXT_CHARS))

    def close(self) -> None:
        pass


class TensorBoard:
    """Event files in $TENSORBOARD_DIR when set (verl's variable), else the run folder's tensorboard/."""

    def __init__(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = tensorboard_dir(run.log_dir)
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def resume(self, step: int) -> None:
        """Events after `step` (a crashed process's) are hidden from TensorBoard: purge_step=step+1."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=step + 1)

    def log(self, values: Mapping[str, float], finite: Mapping[str, float], step: int) -> None:
        for k, v in finite.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def log_generations(self, samples: List[dict], step: int) -> None:
        self.writer.add_text(VAL_GENERATIONS_KEY, format_val_generations(samples, step), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def tensorboard_dir(default: str) -> str:
    """$TENSORBOARD_DIR (verl/utils/tracking.py reads the same variable; the pipeline hands the driver's value,
    made absolute, to every worker), else `default`."""
    return os.environ.get("TENSORBOARD_DIR") or default


def _generation_columns(samples: List[dict]) -> List[str]:
    """verl's wandb table: one row per validation, input_i / output_i / score_i per sample."""
    return ["step"] + [f"{c}_{i + 1}" for i in range(len(samples)) for c in ("input", "output", "score")]


class Wandb:
    def __init__(self, run: RunInfo) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=run.project, name=run.experiment, entity=os.environ.get("WANDB_ENTITY"),
                              config=run.config)
        self.rows: List[list] = []
        self.step = -1  # the highest step logged: wandb drops a log at a lower one

    def _log(self, payload: Dict[str, Any], step: int) -> None:
        if step < self.step:  # a validation that finished beside later steps (trainer.val_async): keep its step
            self.wandb.log({**payload, "val/step": float(step)})
            return
        self.step = step
        self.wandb.log(payload, step=step)

    def log(self, values: Mapping[str, float], finite: Mapping[str, float], step: int) -> None:
        self._log(dict(values), step)

    def log_generations(self, samples: List[dict], step: int) -> None:
        self.rows.append([step] + [x for s in samples for x in (s["input"], s["output"], s["score"])])
        width = len(_generation_columns(samples))
        rows = [r for r in self.rows if len(r) == width]  # a table has one width: the rows of this sample count
        self._log({VAL_GENERATIONS_KEY: self.wandb.Table(columns=_generation_columns(samples), data=rows)}, step)

    def close(self) -> None:
        self.wandb.finish()


class SwanLab:
    def __init__(self, run: RunInfo) -> None:
        import swanlab

        self.swanlab = swanlab
        if os.environ.get("SWANLAB_API_KEY"):
            swanlab.login(os.environ["SWANLAB_API_KEY"])
        swanlab.init(project=run.project, experiment_name=run.experiment, config={"FRAMEWORK": "verl_async", **run.config},
                     logdir=os.environ.get("SWANLAB_LOG_DIR", "swanlog"), mode=os.environ.get("SWANLAB_MODE", "cloud"))

    def log(self, values: Mapping[str, float], finite: Mapping[str, float], step: int) -> None:
        self.swanlab.log(dict(values), step=step)

    def log_generations(self, samples: List[dict], step: int) -> None:
        self.swanlab.log({VAL_GENERATIONS_KEY: self.swanlab.Text(format_val_generations(samples, step))}, step=step)

    def close(self) -> None:
        self.swanlab.finish()


_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts (verl's rule): @ -> _at_, repeated slashes -> one, other odd characters -> _."""
    return _MLFLOW_BAD.sub("_", re.sub(r"/+", "/", key.replace("@", "_at_")))


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """Nested config -> {"a/b/c": value} (lists by index), for MLflow's run parameters."""
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree) if isinstance(tree, (list, tuple)) else None
    if items is None:
        return {prefix: tree}
    out: Dict[str, Any] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


class MLflow:
    def __init__(self, run: RunInfo) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", MLFLOW_DEFAULT_URI))
        if os.environ.get("MLFLOW_RUN_ID"):  # a platform (Azure ML, Databricks) started the run
            mlflow.start_run(run_id=os.environ["MLFLOW_RUN_ID"])
        else:  # MLflow's experiment is verl's project
            experiment = mlflow.set_experiment(run.project)
            mlflow.start_run(experiment_id=experiment.experiment_id, run_name=run.experiment)
        if run.config:
            mlflow.log_params(flatten(run.config))

    def log(self, values: Mapping[str, float], finite: Mapping[str, float], step: int) -> None:
        self.mlflow.log_metrics({mlflow_key(k): v for k, v in finite.items()}, step=step)

    def log_generations(self, samples: List[dict], step: int) -> None:
        self.mlflow.log_dict(samples, f"val_generations/step_{step}.json")

    def close(self) -> None:
        self.mlflow.end_run()


class File:
    """verl's file logger: one JSON line per call, {"step": s, "data": {...}}."""

    def __init__(self, run: RunInfo) -> None:
        self.path = os.environ.get("VERL_FILE_LOGGER_PATH") or run.file_path
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.fh = open(self.path, "a", encoding="utf-8")

    def resume(self, step: int) -> None:
        """Keep the lines of steps <= `step` (the checkpoint's); later ones belong to the crashed process."""
        self.fh.close()
        with open(self.path, encoding="utf-8") as f:
            keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(tmp, self.path)
        self.fh = open(self.path, "a", encoding="utf-8")

    def _write(self, data: Mapping[str, Any], step: int) -> None:
        self.fh.write(json.dumps({"step": step, "data": dict(data)}, allow_nan=False) + "\n")
        self.fh.flush()

    def log(self, values: Mapping[str, float], finite: Mapping[str, float], step: int) -> None:
        self._write({k: finite.get(k) for k in values}, step)  # NaN/inf as null, as verl's orjson writes them

    def log_generations(self, samples: List[dict], step: int) -> None:
        self._write({VAL_GENERATIONS_KEY: samples}, step)

    def close(self) -> None:
        self.fh.close()


BACKENDS: Dict[str, Callable[[RunInfo], Any]] = {
    "console": Console, "tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow, "swanlab": SwanLab, "file": File,
}
