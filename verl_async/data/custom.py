"""`data.custom_cls.{path,name}`: a user's dataset class, named by file and class as in verl.

verl instantiates any `torch.utils.data.Dataset` subclass it finds there; its custom classes
(ReTool's among them) subclass verl's `RLHFDataset` and override `_read_files_and_tokenize` to
read the files and `map` each row into verl's schema. Here the reading, schema checks,
chat template, tokenising, overlong handling and bad-row accounting stay ours (the Rollouter
and the preflight see the same prompts), and a subclass of `RLHFDataset` below overrides only:

- `map_fn(self, row, *, file) -> dict | None`: one row of `file` (a dict of its columns, as
  read) to a row in verl's schema (`prompt` as chat messages, `data_source`,
  `reward_model.ground_truth`; optional `ability`, `extra_info`, `agent_name`). None leaves the
  row out (counted in `stats.dropped`); an exception makes it a bad row (file, row, reason:
  skipped and counted under `data.skip_bad_rows`, else the run stops).
- `read_file(self, path) -> pyarrow.Table` (optional): how one file of `data.*_files` is
  read; the default reads parquet.

verl's `_read_files_and_tokenize`, `__getitem__` and `_build_messages` are never called here, so a
class that defines one is refused by name rather than silently ignored. The same class builds
the train and the val dataset (`dataset_from_config`), in the preflight and in the Rollouter.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

import pyarrow as pa

from verl_async.data.dataset import PromptDataset, read_table
from verl_async.utils.pyfile import import_file

PATH_KEY, NAME_KEY = "data.custom_cls.path", "data.custom_cls.name"
_VERL_ONLY = ("_read_files_and_tokenize", "__getitem__", "_build_messages")


class DatasetClassError(ValueError):
    """`key` is the data.custom_cls key at fault; `str(err)` is "<key>: <reason>", one line."""

    def __init__(self, key: str, reason: str):
        self.key, self.reason = key, reason
        super().__init__(f"{key}: {reason}")


class RLHFDataset(PromptDataset):
    """The base of a `data.custom_cls` class: override `map_fn` (and `read_file` for another file format)."""

    def read_file(self, path: str) -> pa.Table:
        """One file of data.*_files as a table (default: parquet; errors name the file)."""
        return read_table(path, self.key)

    def map_fn(self, row: dict[str, Any], *, file: str) -> Optional[dict[str, Any]]:
        """One row as read from `file` -> a row in verl's schema, or None to leave it out."""
        return row

    def _read_rows(self, path: str) -> list[Optional[dict[str, Any]]]:
        rows: list[Optional[dict[str, Any]]] = []
        for r, raw in enumerate(self.read_file(path).to_pylist()):
            try:
                mapped = self.map_fn(raw, file=path)
            except Exception as exc:
                self._bad_row(path, r, f"{type(self).__name__}.map_fn failed: {exc!r}")
                mapped = None
            else:
                if mapped is None:
                    self.stats.dropped += 1
                elif not isinstance(mapped, Mapping):
                    self._bad_row(path, r, f"{type(self).__name__}.map_fn returned {type(mapped).__name__}, "
                                           "expected a dict (a row in verl's schema) or None")
                    mapped = None
            rows.append(None if mapped is None else dict(mapped))
        return rows


def load_dataset_class(path: Optional[str], name: Optional[str]) -> type[PromptDataset]:
    """The class `name` in the file `path` (data.custom_cls), checked; PromptDataset when `path` is unset.

    A file is executed once per process (verl_async.utils.pyfile), so the train and val datasets,
    and a reward function from the same file, share one module.
    """
    if not path:
        return PromptDataset
    full = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(full):
        raise DatasetClassError(PATH_KEY, f"no such file: {path}")
    if not name:
        raise DatasetClassError(NAME_KEY, f"not set; name the dataset class in {path}")
    try:
        module = import_file(full)
    except Exception as exc:
        raise DatasetClassError(PATH_KEY, f"{path}: importing it failed: {exc!r}") from exc
    cls = getattr(module, str(name), None)
    if not isinstance(cls, type):
        raise DatasetClassError(NAME_KEY, f"no class {name!r} in {path}")
    if not issubclass(cls, RLHFDataset):
        raise DatasetClassError(NAME_KEY, f"{name} in {path} is not a subclass of verl_async.data.RLHFDataset "
                                          "(subclass it and override map_fn)")
    for method in _VERL_ONLY:
        if any(method in vars(k) for k in cls.__mro__[: cls.__mro__.index(RLHFDataset)]):
            raise DatasetClassError(NAME_KEY, f"{name} in {path} defines {method}, which verl_async never calls; "
                                              "map each row in map_fn(row, *, file) (and read files in read_file)")
    return cls


def dataset_from_config(data_cfg: Mapping[str, Any], tokenizer: Any, split: str = "train",
                        tools: Optional[Sequence[dict]] = None) -> PromptDataset:
    """`data.<split>_files` as a dataset of the class `data.custom_cls` names (PromptDataset when unset)."""
    custom = data_cfg.get("custom_cls") or {}
    cls = load_dataset_class(custom.get("path"), custom.get("name"))
    return cls.from_config(data_cfg, tokenizer, split, tools=tools)
