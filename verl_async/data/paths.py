"""Where prompt data lives: `data.*_files` values to parquet paths.

The one place that understands builtin://NAME (the built-in task, verl_async.data.builtin),
`~`, folders and lists.
"""

from __future__ import annotations

import os
from typing import Sequence, Union

from verl_async.data.builtin import SCHEME, builtin_path


def resolve_data_files(value: Union[str, Sequence[str], None], key: str = "data.train_files") -> list[str]:
    """`data.train_files` / `data.val_files` -> real parquet paths.

    Accepts a string or a list (Hydra ListConfig too). builtin://NAME becomes its
    cached file; `~` is expanded; a folder stands for the *.parquet files in it.
    Missing paths are left for the loader to report (with the file name).
    """
    if value is None:
        raise ValueError(f"{key} is not set")
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise ValueError(f"{key} is empty")
    paths: list[str] = []
    for item in items:
        item = str(item).strip()
        if item.startswith(SCHEME):
            paths.append(builtin_path(item[len(SCHEME) :]))
            continue
        path = os.path.expanduser(item)
        if os.path.isdir(path):
            found = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))
            if not found:
                raise FileNotFoundError(f"{key}: folder {item!r} holds no .parquet file")
            paths.extend(found)
        else:
            paths.append(path)
    return paths
