"""The transformers releases verl_async supports, and the start-up check that refuses others.

The range is pyproject.toml's `transformers` requirement (tests/test_versions.py keeps the
two equal). Why these bounds (docs/versions.md):

* 4.56.0 and 4.56.1: `get_decoder()` of a CausalLM returns None (transformers issue 40815,
  fixed in 4.56.2); the native engine's prefill calls the decoder and fails;
* below 4.56 `from_pretrained(dtype=...)`, which every model load here uses, does not exist
  (the keyword reaches the model's __init__: TypeError); below 4.53 transformers has no
  `masking_utils` at all, so a packed sdpa forward would not detect packing from
  `position_ids` and packed sequences would attend to each other, silently;
* the top is the newest release tested, 5.24 (5.25 and later are refused until tested): minors
  change the interfaces the native engine and the trainer plug into (5.24 renamed the forward's
  `past_key_values` to `cache` and removes the old name in 5.40; the engine reads the keyword from
  the signature, `rollout/native/runner.py` `cache_keyword`), and a release nobody ran is not
  promised. Raise TRANSFORMERS_BELOW (and pyproject.toml) after the suite passed on the newer one.

CI runs the whole suite on the newest release the range allows and the engine, trainer and pipeline
tests on TRANSFORMERS_MIN (scripts/setup_tfmin.sh). Tested: 4.56.2, 5.17 (the GPU image), 5.24. The check reads the installed version from
package metadata (no import of transformers or torch), so config checks can run it early.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Optional

TRANSFORMERS_MIN = "4.56.2"  # the floor CI tests (scripts/setup_tfmin.sh installs exactly this)
TRANSFORMERS_NEWEST_TESTED = "5.24"  # the newest release the suite passed on (CPU, 2026-11-27)
TRANSFORMERS_BELOW = "5.25"  # first release not supported (not tested yet)
TRANSFORMERS_REQUIREMENT = "transformers>=4.56.2,<5.25"  # as in pyproject.toml


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
        why = f"newer than the newest release tested, {TRANSFORMERS_NEWEST_TESTED}"
    else:
        return None
    return (f"transformers {installed} is installed ({why}); verl_async needs {TRANSFORMERS_REQUIREMENT} "
            f"(tested: {TRANSFORMERS_MIN}, 5.17 and {TRANSFORMERS_NEWEST_TESTED}): {fix}")


def check_transformers(installed: Optional[str] = None) -> None:
    """Raise UnsupportedTransformersError unless the installed (or given) transformers is supported."""
    problem = transformers_problem(installed)
    if problem is not None:
        raise UnsupportedTransformersError(problem)
