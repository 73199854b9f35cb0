"""Prompt dataset: verl-schema parquet -> tokenised chat prompts, plus a resumable iterator.

Rows follow verl's schema: `data_source`, `prompt` (chat messages [{role, content}]),
`ability`, `reward_model{style, ground_truth}`, `extra_info{split, index, ...}`.
Everything is read and tokenised up front, so a bad file, a bad row or an overlong
prompt is reported before training starts, with the file, the row and the reason.

- A bad *file* (missing, not parquet, empty, missing column, wrong column type)
  always fails.
- A bad *row* (prompt not a list of {role, content}, no ground truth, no
  data_source, chat template error) is skipped and counted when
  `data.skip_bad_rows` (the default), or fails.
- A prompt longer than `data.max_prompt_length` is dropped and counted when
  `data.filter_overlong_prompts`, else handled by `data.truncation`:
  `error` fails (file, row, lengths), `left` keeps the last tokens, `right` the
  first, `middle` both ends (verl semantics).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np
import pyarrow as pa

from verl_async.data.paths import resolve_data_files

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")
PROGRESS_MIN_ROWS = 5000  # show a progress bar for files at least this long
_LOGGED_BAD_ROWS = 20


class DataError(ValueError):
    """A data file or row is unusable; the message names the file, the row and the reason."""


@dataclass
class PromptItem:
    """One prompt, ready for the engines and the reward manager."""

    index: int  # position in the dataset (stable for the same files and settings)
    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any]
    raw_prompt: str  # chat-templated text, before any truncation
    messages: list[dict[str, str]]
    ability: str = ""
    source: str = ""  # "file:row", for error messages and debugging
    agent_name: str = ""  # verl's `agent_name` column (multi-turn rows: tool_agent)


@dataclass
class BadRow:
    file: str
    row: int
    reason: str


@dataclass
class LoadStats:
    files: int = 0
    rows_read: int = 0
    rows_kept: int = 0
    bad_rows: int = 0
    filtered_overlong: int = 0
    truncated: int = 0
    dropped: int = 0  # rows a data.custom_cls map_fn left out (verl_async.data.custom)
    bad_row_examples: list[BadRow] = field(default_factory=list)  # the first few


# --- file and schema checks ----------------------------------------------------------

def read_table(path: str, key: str = "data files") -> pa.Table:
    """The parquet file as a table, or a DataError/FileNotFoundError naming it and why."""
    import os

    import pyarrow.parquet as pq

    if not os.path.exists(path):
        raise FileNotFoundError(f"{key}: {path}: no such file")
    if os.path.isdir(path):
        raise DataError(f"{key}: {path}: is a folder, expected a parquet file")
    if os.path.getsize(path) == 0:
        raise DataError(f"{key}: {path}: empty file (0 bytes)")
    try:  # ParquetFile, not read_table: read_table goes through pyarrow.dataset, which imports pandas (~1 s per process)
        with pq.ParquetFile(path) as parquet:
            table = parquet.read()
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{key}: {path}: not a readable parquet file ({exc})") from exc
    if table.num_rows == 0:
        raise DataError(f"{key}: {path}: the file has no rows")
    return table


def _is_string(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _struct_fields(t: pa.DataType) -> set[str]:
    return {t.field(i).name for i in range(t.num_fields)} if pa.types.is_struct(t) else set()


def _is_message_list(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    return {"role", "content"} <= _struct_fields(t.value_type)


def check_schema(table: pa.Table, path: str, prompt_key: str, reward_fn_key: str) -> None:
    """Required columns exist with verl's types; raise a DataError naming the column otherwise.

    An all-null column has arrow type null; it passes here and every row is then
    reported as a bad row.
    """
    names = table.column_names
    for col in (prompt_key, "reward_model", reward_fn_key):
        if col not in names:
            raise DataError(f"{path}: missing column {col!r} (columns: {', '.join(names)})")
    schema = table.schema
    prompt_t, rm_t, ds_t = (schema.field(c).type for c in (prompt_key, "reward_model", reward_fn_key))
    if not (pa.types.is_null(prompt_t) or _is_message_list(prompt_t)):
        raise DataError(
            f"{path}: column {prompt_key!r} has type {prompt_t}, expected a list of chat messages "
            f"list<struct<role: string, content: string>> (data.prompt_key={prompt_key!r})"
        )
    if not (pa.types.is_null(rm_t) or "ground_truth" in _struct_fields(rm_t)):
        raise DataError(f"{path}: column 'reward_model' has type {rm_t}, expected struct<style, ground_truth>")
    if not (pa.types.is_null(ds_t) or _is_string(ds_t)):
        raise DataError(f"{path}: column {reward_fn_key!r} has type {ds_t}, expected string (data.reward_fn_key)")
    if "extra_info" in names:
        ei_t = schema.field("extra_info").type
        if not (pa.types.is_struct(ei_t) or pa.types.is_null(ei_t) or pa.types.is_map(ei_t)):
            raise DataError(f"{path}: column 'extra_info' has type {ei_t}, expected a struct")


def _row_problem(messages: Any, reward_model: Any, data_source: Any) -> Optional[str]:
    """Why a row cannot be used, or None."""
    if not isinstance(messages, list) or not messages:
        return "prompt is not a non-empty list of {role, content} messages"
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not msg.get("role"):
            return f"prompt message {i} has no role"
        if not isinstance(msg.get("content"), str):
            return f"prompt message {i} has no text content"
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        return "reward_model.ground_truth is missing"
    if not isinstance(data_source, str) or not data_source:
        return "data_source is missing"
    return None


def truncate(ids: list[int], max_len: int, mode: str) -> list[int]:
    """verl's prompt truncation: left keeps the tail, right the head, middle both ends."""
    if len(ids) <= max_len:
        return ids
    if mode == "left":
        return ids[-max_len:]
    if mode == "right":
        return ids[:max_len]
    if mode == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head) :]
    raise ValueError(f"data.truncation={mode!r}: expected one of {TRUNCATION_MODES}")


# --- the dataset -----------------------------------------------------------------------

class PromptDataset(Sequence[PromptItem]):
    def __init__(
        self,
        files: Union[str, Sequence[str]],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        reward_fn_key: str = "data_source",
        max_prompt_length: Optional[int] = None,
        filter_overlong_prompts: bool = False,
        truncation: str = "error",
        skip_bad_rows: bool = True,
        key: str = "data.train_files",
        show_progress: Optional[bool] = None,
        tools: Optional[Sequence[dict]] = None,
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={truncation!r}: expected one of {TRUNCATION_MODES}")
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; set actor_rollout_ref.model.custom_chat_template"
            )
        self.tokenizer = tokenizer
        self.prompt_key, self.reward_fn_key = prompt_key, reward_fn_key
        self.max_prompt_length = max_prompt_length
        self.filter_overlong_prompts = filter_overlong_prompts
        self.truncation = truncation
        self.skip_bad_rows = skip_bad_rows
        self.key = key
        self.show_progress = show_progress
        # multi-turn: the tools' OpenAI schemas go to the chat template (as verl's agent loop renders the prompt)
        self.template_kwargs = {"tools": list(tools)} if tools else {}
        self.files = resolve_data_files(files, key)
        self.stats = LoadStats(files=len(self.files))
        self.items: list[PromptItem] = []
        for path in self.files:
            self._load_file(path)
        if not self.items:
            dropped = f", left out by map_fn: {self.stats.dropped}" if self.stats.dropped else ""
            raise DataError(
                f"{key}: no usable prompt in {', '.join(self.files)} (bad rows: {self.stats.bad_rows}, "
                f"filtered as overlong: {self.stats.filtered_overlong}{dropped})"
            )
        s = self.stats
        logger.info(
            "%s: %d prompts from %d file(s); %d bad rows skipped, %d overlong filtered, %d truncated, %d left out",
            key, s.rows_kept, s.files, s.bad_rows, s.filtered_overlong, s.truncated, s.dropped,
        )

    @classmethod
    def from_config(cls, data_cfg: Mapping[str, Any], tokenizer: Any, split: str = "train",
                    tools: Optional[Sequence[dict]] = None) -> "PromptDataset":
        """Build from verl's `data.*` keys; `split` picks `train_files` or `val_files`; `tools` (schemas) for the template."""
        key = f"{split}_files"
        if key not in data_cfg:
            raise ValueError(f"data.{key} is not set")
        return cls(
            data_cfg[key],
            tokenizer,
            prompt_key=data_cfg.get("prompt_key", "prompt"),
            reward_fn_key=data_cfg.get("reward_fn_key", "data_source"),
            max_prompt_length=data_cfg.get("max_prompt_length"),
            filter_overlong_prompts=bool(data_cfg.get("filter_overlong_prompts", False)),
            truncation=data_cfg.get("truncation", "error"),
            skip_bad_rows=bool(data_cfg.get("skip_bad_rows", True)),
            key=f"data.{key}",
            tools=tools,
        )

    # -- loading ------------------------------------------------------------------------

    def _bad_row(self, path: str, row: int, reason: str) -> None:
        if not self.skip_bad_rows:
            raise DataError(f"{path}: row {row}: {reason} (data.skip_bad_rows=false)")
        self.stats.bad_rows += 1
        if len(self.stats.bad_row_examples) < _LOGGED_BAD_ROWS:
            self.stats.bad_row_examples.append(BadRow(path, row, reason))
            logger.warning("%s: skipping row %d: %s", path, row, reason)

    def _read_rows(self, path: str) -> list[Optional[dict[str, Any]]]:
        """The rows of one file in verl's schema, checked as a file; None marks a row already counted
        (data.custom_cls subclasses read and map rows here: verl_async.data.custom)."""
        table = read_table(path, self.key)
        check_schema(table, path, self.prompt_key, self.reward_fn_key)
        return table.to_pylist()

    def _load_file(self, path: str) -> None:
        rows = self._read_rows(path)
        self.stats.rows_read += len(rows)
        order: Any = range(len(rows))
        if self.show_progress or (self.show_progress is None and len(rows) >= PROGRESS_MIN_ROWS):
            from tqdm import tqdm

            order = tqdm(order, desc=f"tokenising {path}", unit="row")
        for r in order:
            if rows[r] is not None:
                self._add_row(path, r, rows[r])

    def _add_row(self, path: str, r: int, row: dict[str, Any]) -> None:
        messages, reward_model = row.get(self.prompt_key), row.get("reward_model")
        data_source = row.get(self.reward_fn_key)
        problem = _row_problem(messages, reward_model, data_source)
        if problem is not None:
            self._bad_row(path, r, problem)
            return
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **self.template_kwargs)
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        except Exception as exc:
            self._bad_row(path, r, f"chat template / tokenizer failed: {exc!r}")
            return
        ids = self._fit(ids, path, r)
        if ids is None:
            return
        self.items.append(
            PromptItem(
                index=len(self.items),
                prompt_ids=ids,
                data_source=data_source,
                ground_truth=reward_model["ground_truth"],
                extra_info=dict(row.get("extra_info") or {}),
                raw_prompt=text,
                messages=messages,
                ability=row.get("ability") or "",
                source=f"{path}:{r}",
                agent_name=row.get("agent_name") or "",
            )
        )
        self.stats.rows_kept += 1

    def _fit(self, ids: list[int], path: str, row: int) -> Optional[list[int]]:
        limit = self.max_prompt_length
        if limit is None or len(ids) <= limit:
            return ids
        if self.filter_overlong_prompts:
            self.stats.filtered_overlong += 1
            return None
        if self.truncation == "error":
            raise DataError(
                f"{path}: row {row}: prompt is {len(ids)} tokens, longer than data.max_prompt_length={limit} "
                f"(data.truncation=error; set data.filter_overlong_prompts=true or data.truncation=left|right|middle)"
            )
        self.stats.truncated += 1
        return truncate(ids, limit, self.truncation)

    # -- Sequence -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):  # type: ignore[override]
        return self.items[i]

    def prompt_lengths(self) -> list[int]:
        return [len(item.prompt_ids) for item in self.items]


# --- the prompt iterator -------------------------------------------------------------------

class Draw(NamedTuple):
    epoch: int
    position: int  # place in this epoch's order
    item: PromptItem

    @property
    def uid(self) -> str:
        """Unique per (epoch, dataset row): the Rollouter's exactly-once key."""
        return f"{self.epoch}:{self.item.index}"


class PromptIterator:
    """Epochs over a dataset, shuffled per epoch by (seed, epoch), resumable at the exact prompt.

    The order of epoch e is a pure function of (seed, e, len(dataset)), so the cursor
    is just (epoch, position): `state_dict()` after k draws, loaded into a fresh
    iterator over the same data, continues with draw k + 1.
    """

    def __init__(
        self,
        dataset: Sequence[PromptItem],
        *,
        shuffle: bool = True,
        seed: int = 1,
        total_epochs: Optional[int] = None,
    ) -> None:
        if total_epochs is not None and total_epochs < 1:
            raise ValueError(f"total_epochs must be >= 1 or None, got {total_epochs}")
        if len(dataset) == 0:
            raise ValueError("PromptIterator: the dataset is empty")
        self.dataset = dataset
        self.shuffle, self.seed, self.total_epochs = shuffle, int(seed), total_epochs
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    def order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order epoch `epoch` visits them."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def __iter__(self) -> Iterator[Draw]:
        return self

    def __next__(self) -> Draw:
        if self.position >= len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        if self.total_epochs is not None and self.epoch >= self.total_epochs:
            raise StopIteration
        if self._order_epoch != self.epoch:
            self._order_epoch, self._order = self.epoch, self.order(self.epoch)
        draw = Draw(self.epoch, self.position, self.dataset[int(self._order[self.position])])
        self.position += 1
        return draw

    @property
    def exhausted(self) -> bool:
        return (
            self.total_epochs is not None
            and self.epoch + (self.position >= len(self.dataset)) >= self.total_epochs
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_items": len(self.dataset),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["num_items"]) != len(self.dataset):
            raise ValueError(
                f"cannot resume the prompt iterator: the checkpoint was taken over {state['num_items']} prompts, "
                f"the dataset now has {len(self.dataset)} (data files or filtering changed)"
            )
        if not 0 <= int(state["position"]) <= len(self.dataset):
            raise ValueError(f"cannot resume the prompt iterator: position {state['position']} out of range")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self._order_epoch = -1
