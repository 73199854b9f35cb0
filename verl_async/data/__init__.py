"""Prompt data: verl-schema parquet files, the chat-templated dataset, the built-in task."""

from verl_async.data.dataset import (
    TRUNCATION_MODES,
    BadRow,
    DataError,
    Draw,
    LoadStats,
    PromptDataset,
    PromptItem,
    PromptIterator,
    check_schema,
    read_table,
    truncate,
)
from verl_async.data.files import write_rows
from verl_async.data.paths import resolve_data_files

__all__ = [
    "TRUNCATION_MODES",
    "BadRow",
    "DataError",
    "Draw",
    "LoadStats",
    "PromptDataset",
    "PromptItem",
    "PromptIterator",
    "check_schema",
    "read_table",
    "resolve_data_files",
    "truncate",
    "write_rows",
]
