"""Where the Hydra config lives and how command lines are handed to Hydra.

Two small adjustments make verl launch scripts work unchanged:

* `--config-path=config` run from the repository root names the repository's
  `config/` folder. Hydra would resolve it against the folder of the entry module
  (`recipe/`), so a relative config path is made absolute: against the current
  folder when it exists there, else against the folder that holds config/.
* A plain `a.b=v` override of a key that the YAML does not define would make Hydra
  stop with a multi-line message. Dotted overrides are passed as `++a.b=v` (set or
  add), so an unknown key reaches `validate()`, which names it in one line (and
  free-form nodes such as `critic.*` or `...engine_kwargs.vllm.*` can be set
  without the `+`). `+a.b=v` becomes `++a.b=v` too: verl's scripts add keys with `+`
  that exist here (Hydra would stop on "Could not append").

And verl's ways of choosing the trainer (`verl_choice`): `--config-name ppo_trainer` /
`ppo_megatron_trainer` name ours (fully_async_ppo_*), `model_engine=megatron|dp` picks
the Megatron or the FSDP2 config; other engines and config names that do not exist are
answered in one line (ConfigError) instead of Hydra's message.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

DEFAULT_CONFIG_NAME = "fully_async_ppo_trainer"
MEGATRON_CONFIG_NAME = "fully_async_ppo_megatron_trainer"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _find_config_dir() -> Path:
    """The repository's config/ (source tree, editable install), else the installed copy."""
    for candidate in (REPO_ROOT / "config", Path(sys.prefix) / "share" / "verl_async" / "config"):
        if (candidate / f"{DEFAULT_CONFIG_NAME}.yaml").is_file():
            return candidate
    return REPO_ROOT / "config"


CONFIG_DIR = _find_config_dir()

_CONFIG_PATH_FLAGS = ("--config-path", "-cp")


def relax_overrides(overrides: Iterable[str]) -> List[str]:
    """`a.b=v` and `+a.b=v` -> `++a.b=v`; group overrides, hydra.* keys, deletions and `++` are kept."""
    out = []
    for item in overrides:
        body = item[1:] if item.startswith("+") and not item.startswith("++") else item
        key, eq, _ = body.partition("=")
        plain = eq and not body.startswith(("+", "~")) and "." in key
        if plain and not key.startswith("hydra.") and not any(c in key for c in "@/ "):
            item = "++" + body
        out.append(item)
    return out


# verl's config names -> ours; verl's model_engine group -> the config that trains with it
VERL_CONFIG_NAMES = {"ppo_trainer": DEFAULT_CONFIG_NAME, "ppo_megatron_trainer": MEGATRON_CONFIG_NAME}
MODEL_ENGINES = {"dp": DEFAULT_CONFIG_NAME, "fsdp": DEFAULT_CONFIG_NAME, "megatron": MEGATRON_CONFIG_NAME}


def verl_choice(argv: Sequence[str], cwd: Optional[str] = None) -> List[str]:
    """verl's `--config-name ppo_*trainer` and `model_engine=...` as our config name (see the module docstring).

    Raises ConfigError (one line) for an engine verl_async lacks or a config name found nowhere."""
    from verl_async.config.errors import ConfigError

    args, name, engine, config_dir = [], None, None, None
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag in ("--config-name", "-cn"):
            if not eq and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            name = value
        elif flag in _CONFIG_PATH_FLAGS:
            config_dir = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
            args.append(arg)
            if not eq and i + 1 < len(argv):
                args.append(argv[i + 1])
                i += 1
        elif flag.lstrip("+") == "model_engine" and eq:
            engine = value
        else:
            args.append(arg)
        i += 1
    if engine is not None:
        if engine not in MODEL_ENGINES:
            raise ConfigError("model_engine", f"{engine}: not a verl_async trainer; use model_engine=dp (FSDP2) or "
                                              "model_engine=megatron")
        name = MODEL_ENGINES[engine]
    if name is None:
        return args
    stem = name.removesuffix(".yaml")
    stem = VERL_CONFIG_NAMES.get(stem, stem)
    folder = Path(_absolute_config_path(config_dir, cwd)) if config_dir else CONFIG_DIR
    if not (folder / f"{stem}.yaml").is_file() and not (CONFIG_DIR / f"{stem}.yaml").is_file():
        raise ConfigError("--config-name", f"{name}: no such config in {folder} (verl_async's: {DEFAULT_CONFIG_NAME}, "
                                           f"{MEGATRON_CONFIG_NAME}; verl's ppo_trainer and ppo_megatron_trainer "
                                           "name them)")
    return [f"--config-name={stem}", *args]


def _absolute_config_path(path: str, cwd: Optional[str] = None) -> str:
    if os.path.isabs(path) or path.startswith("pkg://"):
        return path
    for base in (Path(cwd or os.getcwd()), CONFIG_DIR.parent):
        if (base / path).is_dir():
            return str((base / path).resolve())
    return path  # Hydra reports it as not found


def hydra_argv(argv: Sequence[str], cwd: Optional[str] = None) -> List[str]:
    """Rewrite a command line (without the program name) for `@hydra.main`."""
    out: List[str] = []
    args = verl_choice(list(argv), cwd)
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, value = arg.partition("=")
        if flag in _CONFIG_PATH_FLAGS and eq:
            out.append(f"{flag}={_absolute_config_path(value, cwd)}")
        elif arg in _CONFIG_PATH_FLAGS and i + 1 < len(args):
            out += [arg, _absolute_config_path(args[i + 1], cwd)]
            i += 1
        elif arg.startswith("-"):
            out.append(arg)
        else:
            out.extend(relax_overrides([arg]))
        i += 1
    return out


def compose(config_name: str = DEFAULT_CONFIG_NAME, overrides: Sequence[str] = (), config_dir: Optional[str] = None):
    """Compose a config the way the entry point does (for tests and tools)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir or CONFIG_DIR), version_base=None):
        return hydra_compose(config_name=config_name.removesuffix(".yaml"), overrides=relax_overrides(overrides))
