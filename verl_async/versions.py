"""The transformers releases verl_async supports, and the start-up check that refuses others.

The range is pyproject.toml's `transformers` requirement (tests/test_versions.py keeps the
two equal). Why these bounds (README "Supported versions"):

* 4.56.0 and 4.56.1: `get_decoder()` of a CausalLM returns None (transformers issue 40815,
  fixed in 4.56.2); the native engine's prefill calls the decoder and fails;
* below 4.56 `from_pretrained(dtype=...)`, which every model load here uses, does not exist
  (the keyword reaches the model's __init__: TypeError); below 4.53 transformers has no
  `masking_utils` at all, so a packed sdpa forward would not detect packing from
  `position_ids` and packed sequences would attend to each other, silently;
* 6 is a future major: majors change the interfaces the native engine and the trainer
  plug into (the KV cache protocol, attention/mask registries, tokenizer files), so it is
  refused until it is tested.

CI runs the whole suite on the newest release and the engine, trainer and pipeline tests on
TRANSFORMERS_MIN (scripts/setup_tfmin.sh). The check reads the installed version from
package metadata (no import of transformers or torch), so config checks can run it early.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Optional

TRANSFORMERS_MIN = "4.56.2"  # the floor CI tests (scripts/setup_tfmin.sh installs exactly this)
TRANSFORMERS_BELOW = "6"  # first release not supported
TRANSFORMERS_REQUIREMENT = "transformers>=4.56.2,<6"  # as in pyproject.toml


class UnsupportedTransformersError(ImportError):
    """The installed transformers is outside the supported range (message says which and how to fix)."""


def installed_transformers_version() -> Optional[str]:
    """The installed transformers' version string, or None when it is not installed."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, int, int]:
    """(major, minor, micro) of a version string; pre-releases count as their release (5.0.0rc1 -> 5.0.0)."""
    match = re.match(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part or 0) for part in match.groups())  # type: ignore[return-value]


def transformers_problem(installed: Optional[str] = None) -> Optional[str]:
    """Why the installed (or given) transformers cannot be used, or None when it is supported."""
    installed = installed if installed is not None else installed_transformers_version()
    fix = f'install a supported release: pip install "{TRANSFORMERS_REQUIREMENT}"'
    if installed is None:
        return f"transformers is not installed; verl_async needs {TRANSFORMERS_REQUIREMENT}: {fix}"
    try:
        release = _release(installed)
    except ValueError:
        return f"transformers {installed!r} has a version verl_async cannot read; it needs {TRANSFORMERS_REQUIREMENT}: {fix}"
    low, high = _release(TRANSFORMERS_MIN), _release(TRANSFORMERS_BELOW)
    if release < low:
        why = "too old"
    elif release >= high:
        why = "a major release not tested yet"
    else:
        return None
    return (f"transformers {installed} is installed ({why}); verl_async needs {TRANSFORMERS_REQUIREMENT} "
            f"(tested in CI: {TRANSFORMERS_MIN} and the newest 5.x): {fix}")


def check_transformers(installed: Optional[str] = None) -> None:
    """Raise UnsupportedTransformersError unless the installed (or given) transformers is supported."""
    problem = transformers_problem(installed)
    if problem is not None:
        raise UnsupportedTransformersError(problem)
