"""Entry point: python -m recipe.fully_async_main [--config-name=NAME] [key=value ...]

Run from the repository root, as verl's recipe is:
    python -m recipe.fully_async_main --config-path=config \
        --config-name=fully_async_ppo_megatron_trainer.yaml data.train_files=... ...
With no arguments it runs the built-in CPU demo (config/fully_async_ppo_trainer.yaml).
`--cfg job` prints the composed config and exits. A bad config prints one line,
"config error: <full.key>: <reason>", to stderr and exits with status 2.
VERL_ASYNC_DRY_RUN=1 stops after the checks (config, device, engine, model, reward function, data,
resume). `--help` prints what a user needs first, then Hydra's help. Ctrl-C ends with one line and
the command that resumes.
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
from verl_async.config.resume import interrupted
from verl_async.config.summary import describe
from verl_async.config.usage import usage
from verl_async.errors import PipelineError
from verl_async.versions import UnsupportedTransformersError

PIPELINE_MODULE = "verl_async.pipeline"  # provides run(cfg): Ray, queue, Rollouter, Trainer, sync
TYPED_ARGV: list[str] = []  # the arguments as typed (Hydra gets them rewritten): a Ctrl-C repeats them


@hydra.main(config_path=str(CONFIG_DIR), config_name=DEFAULT_CONFIG_NAME, version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        cfg = validate(cfg)  # one clear error, naming the key
        facts = preflight(cfg)  # the device exists, the data files read
        print(describe(cfg, facts), flush=True)
        run = pipeline_runner()  # None: dry run, or no pipeline yet (it says so)
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
    except KeyboardInterrupt:  # Ctrl-C: one line and the command that resumes, not a traceback
        print(interrupted(cfg, TYPED_ARGV), file=sys.stderr, flush=True)
        sys.exit(130)


def pipeline_runner() -> Optional[Callable[[DictConfig], None]]:
    if os.environ.get("VERL_ASYNC_DRY_RUN") == "1":
        print("dry run (VERL_ASYNC_DRY_RUN=1): config, device, engine, model, reward function, data (every prompt "
              "tokenised) and resume checked; nothing was started.")
        return None
    if importlib.util.find_spec(PIPELINE_MODULE) is None:
        print(
            "config, device and data are valid. The training pipeline is not implemented yet "
            f"({PIPELINE_MODULE} is missing), so nothing was trained."
        )
        return None
    return importlib.import_module(PIPELINE_MODULE).run


def cli() -> None:
    """Make verl command lines work as written (see verl_async.config.cli), then run Hydra."""
    TYPED_ARGV[:] = sys.argv[1:]
    if {"--help", "-h"} & set(TYPED_ARGV):
        print(usage(), flush=True)  # Hydra's help and the full config follow
    sys.argv[1:] = hydra_argv(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
