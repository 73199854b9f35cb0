"""Shared plumbing of the dataset preprocessors: find the raw splits, convert, write parquet.

Raw data comes from `--local_dataset_path` (a file or a folder, jsonl or parquet as
the HF hub / the original repos export them) or, when that is not given, from the
HF hub (`--data_path`): parquet files fetched with huggingface_hub and read with
pyarrow, or the `datasets` library when it is installed. No network and no local
path is a clear error, not a stack trace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Optional, Sequence

import pyarrow.parquet as pq

from verl_async.data.files import write_rows

RAW_EXTENSIONS = (".parquet", ".jsonl", ".json")


class PreprocessError(ValueError):
    pass


def build_parser(description: str, default_dir: str, data_source: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--local_dir", "--local_save_dir", dest="local_dir", default=default_dir,
                        help=f"output folder for train.parquet / test.parquet (default {default_dir})")
    parser.add_argument("--local_dataset_path", default=None,
                        help="raw dataset on disk: a folder (hub snapshot or repo layout) or one jsonl/parquet file")
    parser.add_argument("--data_path", default=data_source, help=f"HF hub dataset id (default {data_source})")
    return parser


def read_raw_file(path: str) -> list[dict[str, Any]]:
    """Rows of one raw jsonl / json / parquet file."""
    if path.endswith(".parquet"):
        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:
            raise PreprocessError(f"{path}: not a readable parquet file ({exc})") from exc
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.endswith(".json") and text.lstrip().startswith("["):
        return json.loads(text)
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise PreprocessError(f"{path}: line {lineno}: not JSON ({exc.msg})") from exc
    return rows


def _split_of(path: str, splits: Sequence[str]) -> Optional[str]:
    """`train.jsonl`, `train-00000-of-00001.parquet`, `gsm8k_train.parquet` -> "train"."""
    stem = os.path.basename(path).lower().split(".")[0]
    for split in splits:
        if stem == split or stem.startswith((split + "-", split + "_")) or stem.endswith(("_" + split, "-" + split)):
            return split
    return None


def find_split_files(root: str, splits: Sequence[str], config: Optional[str] = None) -> dict[str, list[str]]:
    """Raw files per split under `root` (or `root` itself when it is a file).

    Hub snapshots name shards `<split>-00000-of-00001.parquet`, inside a folder per
    config (`main/`, `socratic/` for gsm8k; `data/` for MATH-lighteval); the original
    repos use `<split>.jsonl`. When several configs hold a split, `config` picks one.
    """
    root = os.path.expanduser(root)
    if not os.path.exists(root):
        raise PreprocessError(f"--local_dataset_path {root!r}: no such file or folder")
    if os.path.isfile(root):
        split = _split_of(root, splits)
        if split is None:
            raise PreprocessError(
                f"--local_dataset_path {root!r}: cannot tell the split from the file name "
                f"(expected a name like {splits[0]}.jsonl or {splits[0]}-00000-of-00001.parquet); pass the folder instead"
            )
        return {split: [root]}
    found: dict[str, list[str]] = {s: [] for s in splits}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = os.path.join(folder, name)
            split = _split_of(path, splits) if name.endswith(RAW_EXTENSIONS) else None
            if split is not None:
                found[split].append(path)
    for split, paths in found.items():
        folders = {os.path.dirname(p) for p in paths}
        if len(folders) > 1 and config:
            preferred = [p for p in paths if config in os.path.relpath(p, root).split(os.sep)[:-1]]
            if preferred:
                found[split] = preferred
        folders = {os.path.dirname(p) for p in found[split]}
        if len(folders) > 1:
            raise PreprocessError(
                f"--local_dataset_path {root!r}: split {split!r} appears in several folders "
                f"({', '.join(sorted(folders))}); point at one of them"
            )
    found = {s: p for s, p in found.items() if p}
    if not found:
        raise PreprocessError(
            f"--local_dataset_path {root!r}: no {'/'.join(splits)} file (*{', *'.join(RAW_EXTENSIONS)}) found"
        )
    return found


def load_local(root: str, splits: Sequence[str], config: Optional[str] = None) -> dict[str, list[dict[str, Any]]]:
    files = find_split_files(root, splits, config)
    return {split: [row for path in paths for row in read_raw_file(path)] for split, paths in files.items()}


def load_from_hub(data_path: str, splits: Sequence[str], config: Optional[str] = None) -> dict[str, list[dict]]:
    """Fetch the hub's parquet export (no `datasets` needed); fall back to `datasets` if present."""
    errors: list[str] = []
    try:
        from huggingface_hub import snapshot_download

        patterns = [f"{config}/*.parquet", "data/*.parquet"] if config else ["*.parquet", "*/*.parquet"]
        local = snapshot_download(repo_id=data_path, repo_type="dataset", allow_patterns=patterns)
        return load_local(local, splits, config)
    except Exception as exc:  # offline, unknown id, layout we do not know
        errors.append(f"huggingface_hub: {type(exc).__name__}: {exc}")
    try:
        import datasets  # optional

        loaded = datasets.load_dataset(data_path, config) if config else datasets.load_dataset(data_path)
        return {s: loaded[s].to_list() for s in splits if s in loaded}
    except ImportError:
        errors.append("datasets: not installed")
    except Exception as exc:
        errors.append(f"datasets: {type(exc).__name__}: {exc}")
    raise PreprocessError(
        f"cannot load {data_path!r} from the HF hub ({'; '.join(errors)[:600]}). Download the dataset "
        f"elsewhere and pass --local_dataset_path (a folder with its train/test jsonl or parquet files)"
    )


def load_raw(args: argparse.Namespace, splits: Sequence[str], config: Optional[str] = None) -> dict[str, list[dict]]:
    if args.local_dataset_path:
        return load_local(args.local_dataset_path, splits, config)
    return load_from_hub(args.data_path, splits, config)


def convert(
    raw: dict[str, list[dict[str, Any]]],
    make_row: Callable[[dict[str, Any], str, int], dict[str, Any]],
    out_dir: str,
    out_names: Optional[dict[str, str]] = None,
) -> dict[str, str]:
    """make_row over every raw row of every split -> `<out_dir>/<split>.parquet`; return the paths.

    A raw row that cannot be converted stops the run with its split, row and reason.
    """
    from tqdm import tqdm

    out_dir = os.path.expanduser(out_dir)
    written: dict[str, str] = {}
    for split, rows in raw.items():
        converted = []
        for idx, example in enumerate(tqdm(rows, desc=f"{split}", unit="row", disable=len(rows) < 1000)):
            try:
                converted.append(make_row(dict(example), split, idx))
            except Exception as exc:
                raise PreprocessError(f"{split} row {idx}: cannot convert ({type(exc).__name__}: {exc})") from exc
        path = os.path.join(out_dir, f"{(out_names or {}).get(split, split)}.parquet")
        written[split] = write_rows(converted, path)
        print(f"wrote {len(converted)} rows to {path}", file=sys.stderr)
    return written


def run_cli(argv: Optional[Sequence[str]], dataset: Any) -> dict[str, str]:
    """The whole preprocessor CLI: parse, load, convert, write; errors as one line, not a trace.

    `dataset` is the preprocessor module: DATA_SOURCE, SPLITS, CONFIG, DEFAULT_DIR,
    its docstring's first line as description, and make_row(example, split, idx).
    """
    description = (dataset.__doc__ or "").strip().splitlines()[0]
    parser = build_parser(description, dataset.DEFAULT_DIR, dataset.DATA_SOURCE)
    args = parser.parse_args(argv)
    try:
        return convert(load_raw(args, dataset.SPLITS, dataset.CONFIG), dataset.make_row, args.local_dir)
    except (PreprocessError, OSError) as exc:
        parser.exit(2, f"error: {exc}\n")
