"""Where prompt data lives: `data.*_files` values to paths, and rows to parquet.

`resolve_data_files` is the one place that understands builtin://NAME (the
built-in task, verl_async.data.builtin), `~`, folders and lists. `verl_row` and
`write_rows` build and write rows for every preprocessor, so all of them produce
the same schema and arrow types.
"""

from __future__ import annotations

import os
from typing import Any, Sequence, Union

import pyarrow as pa
import pyarrow.parquet as pq

from verl_async.data.builtin import SCHEME, builtin_path


def verl_row(
    data_source: str, user_content: str, ground_truth: Any, ability: str, extra_info: dict[str, Any]
) -> dict[str, Any]:
    """One row of verl's schema: a single user message, a rule-style reward."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": user_content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra_info,
    }


def write_rows(rows: Sequence[dict[str, Any]], path: str) -> str:
    """Write verl-schema rows (dicts) to one parquet file; create the folder."""
    if not rows:
        raise ValueError(f"refusing to write {path!r}: no rows")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path


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
