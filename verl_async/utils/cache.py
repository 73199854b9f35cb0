"""Where verl_async caches what it builds locally (built-in data and models), and how a folder gets there."""

from __future__ import annotations

import os
import shutil
from typing import Callable


def cache_path(*parts: str) -> str:
    """$VERL_ASYNC_CACHE/<parts> (default ~/.cache/verl_async/<parts>)."""
    root = os.environ.get("VERL_ASYNC_CACHE") or os.path.join("~", ".cache", "verl_async")
    return os.path.join(os.path.expanduser(root), *parts)


def cached_folder(folder: str, marker: str, build: Callable[[str], None]) -> str:
    """`folder`, built once and reused: complete when it holds the file `marker`, which `build` writes last.

    `build(tmp)` fills a folder private to this process, which is then renamed into place, so a
    concurrent first use never sees half a folder. When two processes build at once, the first
    rename wins and the other drops its copy.
    """
    if os.path.isfile(os.path.join(folder, marker)):
        return folder
    tmp = f"{folder}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed build of this pid
    build(tmp)
    if os.path.exists(folder):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, folder)
    return folder
