"""Entry point: python -m recipe.fully_async_main [--config-name=NAME] [key=value ...]

Run from the repository root, as verl's recipe is:
    python -m recipe.fully_async_main --config-path=config \
        --config-name=fully_async_ppo_megatron_trainer.yaml data.train_files=... ...
With no arguments it runs the built-in CPU demo (config/fully_async_ppo_trainer.yaml).
`--cfg job` prints the composed config and exits. A bad config prints one line,
"config error: <full.key>: <reason>", to stderr and exits with status 2.
`trainer.dry_run=true` (or VERL_ASYNC_DRY_RUN=1 in the environment) stops after checking
the config, the device and the data.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable, Optional

import hydra
from omegaconf import DictConfig

from verl_async.config import CONFIG_DIR, DEFAULT_CONFIG_NAME, ConfigError, hydra_argv, validate
from verl_async.config.preflight import preflight
from verl_async.config.summary import describe
from verl_async.errors import PipelineError
from verl_async.versions import UnsupportedTransformersError

DRY_RUN_ENV = "VERL_ASYNC_DRY_RUN"
PIPELINE_MODULE = "verl_async.pipeline"  # provides run(cfg): Ray, queue, Rollouter, Trainer, sync


@hydra.main(config_path=str(CONFIG_DIR), config_name=DEFAULT_CONFIG_NAME, version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        cfg = validate(cfg)  # one clear error, naming the key
        facts = preflight(cfg)  # the device exists, the data files read
        print(describe(cfg, facts), flush=True)
        if is_dry_run(cfg):
            print("dry run (trainer.dry_run=true or VERL_ASYNC_DRY_RUN=1): config, device and data are valid; "
                  "nothing was started.")
            return
        run = pipeline_runner()  # None: no pipeline yet (it says so)
        if run is not None:
            run(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except UnsupportedTransformersError as err:  # preflight: outside the supported range (verl_async/versions.py)
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except PipelineError as err:  # one side died: the other was stopped; say why, exit non-zero
        print(f"run failed: {err}", file=sys.stderr, flush=True)
        sys.exit(1)


def is_dry_run(cfg: DictConfig) -> bool:
    """The config key, or the environment variable that launch scripts set without touching their overrides."""
    return bool(cfg.trainer.dry_run) or os.environ.get(DRY_RUN_ENV) == "1"


def pipeline_runner() -> Optional[Callable[[DictConfig], None]]:
    if importlib.util.find_spec(PIPELINE_MODULE) is None:
        print(
            "config, device and data are valid. The training pipeline is not implemented yet "
            f"({PIPELINE_MODULE} is missing), so nothing was trained."
        )
        return None
    return importlib.import_module(PIPELINE_MODULE).run


def cli() -> None:
    """Make verl command lines work as written (see verl_async.config.cli), then run Hydra."""
    sys.argv[1:] = hydra_argv(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
