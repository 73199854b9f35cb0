"""Read and write the run-directory logs (format: /work/wt/LOG_FORMATS.md, binding).

``<run_dir>/rollout/lengths.jsonl``: one finished group per line.
``<run_dir>/timeline.jsonl``: one span per line (lane, kind, start, end, version, info).

Readers validate every line and name the file, line and key on bad input, so a
real run's logs fail loudly instead of calibrating nonsense.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

LENGTHS_FILE = Path("rollout") / "lengths.jsonl"
TIMELINE_FILE = Path("timeline.jsonl")

_GROUP_KEYS = {"uid": str, "prompt_len": int, "submit_time": float, "finish_time": float,
               "responses": list}
_RESPONSE_KEYS = {"len": int, "finish_reason": str, "replica": int, "start": float, "end": float}
_RESPONSE_DEFAULTS = {"min_version": 0, "max_version": 0, "probe": False, "moved": False,
                      "regenerated_tokens": 0}
_SPAN_KEYS = {"lane": str, "kind": str, "start": float, "end": float}


class RunLogError(ValueError):
    """A run-directory log line that does not follow LOG_FORMATS.md."""


def lengths_path(run_dir_or_file: str | Path) -> Path:
    """Accept a run dir or the lengths.jsonl file itself."""
    p = Path(run_dir_or_file)
    return p if p.is_file() else p / LENGTHS_FILE


def timeline_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / TIMELINE_FILE


def _jsonl(path: Path) -> Iterable[tuple[int, dict]]:
    if not path.is_file():
        raise RunLogError(f"{path}: file not found")
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise RunLogError(f"{path}:{lineno}: not JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise RunLogError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def _check(obj: dict, keys: dict, where: str) -> None:
    for key, typ in keys.items():
        if key not in obj:
            raise RunLogError(f"{where}: missing key {key!r}")
        val = obj[key]
        ok = isinstance(val, (int, float)) and not isinstance(val, bool) if typ is float else (
            isinstance(val, typ) and not (typ is int and isinstance(val, bool)))
        if not ok:
            raise RunLogError(f"{where}: key {key!r} must be {typ.__name__}, got {val!r}")


def read_lengths(path: str | Path) -> list[dict]:
    """All group records of a lengths.jsonl (run dir or file), validated, defaults filled."""
    p = lengths_path(path)
    groups = []
    for lineno, g in _jsonl(p):
        where = f"{p}:{lineno}"
        _check(g, _GROUP_KEYS, where)
        if not g["responses"]:
            raise RunLogError(f"{where}: group {g['uid']!r} has no responses")
        g.setdefault("index", lineno - 1)
        g.setdefault("epoch", 0)
        g.setdefault("param_version_start", 0)
        g.setdefault("param_version_end", g["param_version_start"])
        for j, r in enumerate(g["responses"]):
            rwhere = f"{where}: responses[{j}]"
            if not isinstance(r, dict):
                raise RunLogError(f"{rwhere}: expected an object")
            _check(r, _RESPONSE_KEYS, rwhere)
            if r["len"] < 0 or r["end"] < r["start"]:
                raise RunLogError(f"{rwhere}: needs len >= 0 and end >= start, got {r}")
            for k, v in _RESPONSE_DEFAULTS.items():
                r.setdefault(k, v)
        groups.append(g)
    if not groups:
        raise RunLogError(f"{p}: no groups")
    return groups


def read_timeline(run_dir: str | Path) -> list[dict]:
    p = timeline_path(run_dir)
    spans = []
    for lineno, s in _jsonl(p):
        _check(s, _SPAN_KEYS, f"{p}:{lineno}")
        if s["end"] < s["start"]:
            raise RunLogError(f"{p}:{lineno}: span ends before it starts: {s}")
        s.setdefault("info", {})
        spans.append(s)
    return spans


def write_jsonl(path: str | Path, records: Iterable[dict]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return p


def write_run_dir(run_dir: str | Path, groups: Iterable[dict], spans: Iterable[dict],
                  config: dict | None = None) -> Path:
    """Write lengths.jsonl + timeline.jsonl (+ config.yaml of verl key names) to ``run_dir``."""
    run_dir = Path(run_dir)
    write_jsonl(run_dir / LENGTHS_FILE, groups)
    write_jsonl(run_dir / TIMELINE_FILE, spans)
    if config is not None:
        from omegaconf import OmegaConf

        OmegaConf.save(OmegaConf.create(config), run_dir / "config.yaml")
    return run_dir
