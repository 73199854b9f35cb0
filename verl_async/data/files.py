"""Rows to parquet: `verl_row` and `write_rows` build and write rows for every preprocessor
(and the built-in task), so all of them produce the same schema and arrow types."""

from __future__ import annotations

import os
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq


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
