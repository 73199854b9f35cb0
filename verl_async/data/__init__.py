"""Prompt data: verl-schema parquet files, the chat-templated dataset, user dataset classes, the built-in task."""

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
from verl_async.data.custom import DatasetClassError, RLHFDataset, dataset_from_config, load_dataset_class
from verl_async.data.files import write_rows
from verl_async.data.paths import resolve_data_files

__all__ = [
    "TRUNCATION_MODES",
    "BadRow",
    "DataError",
    "DatasetClassError",
    "Draw",
    "LoadStats",
    "PromptDataset",
    "PromptItem",
    "PromptIterator",
    "RLHFDataset",
    "check_schema",
    "dataset_from_config",
    "load_dataset_class",
    "read_table",
    "resolve_data_files",
    "truncate",
    "write_rows",
]
