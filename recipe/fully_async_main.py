"""Entry point: python -m recipe.fully_async_main [--config-name=NAME] [key=value ...]

Run from the repository root, as verl's recipe is:
    python -m recipe.fully_async_main --config-path=config \
        --config-name=fully_async_ppo_megatron_trainer.yaml data.train_files=... ...
With no arguments it runs the built-in CPU demo (config/fully_async_ppo_trainer.yaml).
`--cfg job` prints the composed config and exits. A bad config prints one line,
"config error: <full.key>: <reason>", to stderr and exits with status 2.
`trainer.dry_run=true` (or VERL_ASYNC_DRY_RUN=1 in the environment) stops after the checks
(config, device, engine, model, reward function, data, resume). `--help` prints what a user
needs first, then Hydra's help. Ctrl-C ends with one line and the command that resumes.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

# before anything loads torch: OpenMP threads sleep instead of spinning while they wait (verl_async/utils/threads.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import hydra  # noqa: E402
from omegaconf import DictConfig

from verl_async.config import CONFIG_DIR, DEFAULT_CONFIG_NAME, ConfigError, hydra_argv, validate
from verl_async.config.preflight import preflight, with_run_dir
from verl_async.config.resume import interrupted
from verl_async.config.summary import describe
from verl_async.config.usage import usage
from verl_async.errors import PipelineError
from verl_async.utils.startup import process_started_at
from verl_async.versions import UnsupportedTransformersError

DRY_RUN_ENV = "VERL_ASYNC_DRY_RUN"
TYPED_ARGV: list[str] = []  # the arguments as typed (Hydra gets them rewritten): a Ctrl-C repeats them
LAUNCHED_AT: list[float] = []  # when the command started (the process; cli() called in-process: that call)


@hydra.main(config_path=str(CONFIG_DIR), config_name=DEFAULT_CONFIG_NAME, version_base=None)
def main(cfg: DictConfig) -> None:
    entered = time.time()
    try:
        cfg = validate(cfg)  # one clear error, naming the key
        facts = preflight(cfg)  # device, engine, model, reward function, every prompt, what is resumed
        cfg = with_run_dir(cfg, facts)  # a folder holds one run: another run's folder gives a new one
        # a verl script (overrides, none of them async_training.*) is told that it runs fully async, and how not to
        facts["async_keys_given"] = not TYPED_ARGV or any(a.lstrip("+~").startswith("async_training.")
                                                          for a in TYPED_ARGV)
        if facts.get("run_dir_moved"):  # a Ctrl-C's resume command continues this run, in its new folder
            TYPED_ARGV[:] = [a for a in TYPED_ARGV if not a.lstrip("+").startswith("trainer.default_local_dir=")]
            TYPED_ARGV.append(f"trainer.default_local_dir={cfg.trainer.default_local_dir}")
        print(describe(cfg, facts), flush=True)
        if facts["resume"].finished:  # a re-run of a finished run: said at once, Ray never starts
            print(facts["resume"].nothing_to_do(), flush=True)
            return
        if is_dry_run(cfg):
            print("dry run (trainer.dry_run=true or VERL_ASYNC_DRY_RUN=1): config, device, engine, model, reward "
                  "function, data (every prompt tokenised) and resume checked; nothing was started.")
            return
        checked = time.time()
        from verl_async.pipeline import run  # here, not above: a config error prints before torch and Ray load

        launched = LAUNCHED_AT[0] if LAUNCHED_AT else entered
        # the start-up phases before the run starts (utils/startup.py): interpreter and Hydra, checks, imports
        run(cfg, before=[("entry", launched, entered), ("checks", entered, checked), ("imports", checked, time.time())])
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


def is_dry_run(cfg: DictConfig) -> bool:
    """The config key, or the environment variable that launch scripts set without touching their overrides."""
    return bool(cfg.trainer.dry_run) or os.environ.get(DRY_RUN_ENV) == "1"


def cli(launched_at: Optional[float] = None) -> None:
    """Make verl command lines work as written (see verl_async.config.cli), then run Hydra. `launched_at`: when
    the command started (the process's start; default: now), the start of the run's start-up breakdown."""
    LAUNCHED_AT[:] = [launched_at or time.time()]
    TYPED_ARGV[:] = sys.argv[1:]
    if {"--help", "-h"} & set(TYPED_ARGV):
        print(usage(), flush=True)  # Hydra's help and the full config follow
    try:
        sys.argv[1:] = hydra_argv(sys.argv[1:])
    except ConfigError as err:  # verl's --config-name / model_engine= choices that name nothing here
        print(f"config error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli(process_started_at())
