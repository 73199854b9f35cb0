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
  without the `+`).
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
    """`a.b=v` -> `++a.b=v`; group overrides, hydra.* keys and prefixed ones are kept."""
    out = []
    for item in overrides:
        key, eq, _ = item.partition("=")
        plain = eq and not item.startswith(("+", "~")) and "." in key
        if plain and not key.startswith("hydra.") and not any(c in key for c in "@/ "):
            item = "++" + item
        out.append(item)
    return out


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
    args = list(argv)
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
