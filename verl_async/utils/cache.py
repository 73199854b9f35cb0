"""Where verl_async caches what it builds locally (built-in data and models)."""

from __future__ import annotations

import os


def cache_path(*parts: str) -> str:
    """$VERL_ASYNC_CACHE/<parts> (default ~/.cache/verl_async/<parts>)."""
    root = os.environ.get("VERL_ASYNC_CACHE") or os.path.join("~", ".cache", "verl_async")
    return os.path.join(os.path.expanduser(root), *parts)
