"""The built-in "repeat" task: a CPU-sized RL problem with long-tailed response lengths.

    prompt  : Repeat 'ab' 5 times.
    answer  : ababababab

The word is 1-3 random lowercase letters; the count k is 1..20, drawn with
P(k) ~ k^-0.7, so most answers are short and a few are long: response lengths
(bytes of the byte-level tiny tokenizer, + EOS) run from 2 to 61 tokens, median
~10, p90 ~37 — the long tail that makes rollout scheduling matter, inside the
default `data.max_response_length=64`. Prompts are <= 22 bytes (+19 tokens of chat
template), inside `data.max_prompt_length=128`.

Why this task: copying the word is an induction-head job a 2-4 layer model learns in
a few hundred supervised steps; stopping after exactly k copies is the hard part
and improves with RL, large k most slowly, so the accuracy curve has headroom.
Measured on one CPU thread (random Qwen2, hidden 128, 4 layers, lr 3e-3, batch 32):
400 supervised steps give 16% exact answers on val (mean score 0.22, responses too
long); 60 plain on-policy GRPO steps after that (16 prompts x 8, lr 3e-4, ~4 min)
reach 23.5% (score 0.38, lengths back near the truth); 800 supervised steps give ~56%.

Scoring (`compute_score`, deterministic): 1.0 for the exact answer (surrounding
whitespace ignored); a clean repetition of the word m != k times earns partial
credit 0.5 * max(0, 1 - |m - k| / k) (needs extra_info word/times, which the
generator writes), anything else 0. `acc` is 1 only for the exact answer.

`builtin://train` (2000 rows) and `builtin://val` (200 rows, no prompt shared with
train) resolve (verl_async.data.files.resolve_data_files) to parquet files
generated once under $VERL_ASYNC_CACHE/data (default ~/.cache/verl_async/data).
`solution(prompt)` gives the answer for a warm-start's targets.
"""

from __future__ import annotations

import os
import random
import re
import tempfile
from typing import Any, Iterable, Optional

DATA_SOURCE = "verl_async/builtin_repeat"
ABILITY = "copy"
MAX_TIMES = 20
TIMES_ALPHA = 0.7
WORD_LENGTHS = (1, 2, 3)
MAX_ANSWER_CHARS = 60
SPLIT_SIZES = {"train": 2000, "val": 200}
DEFAULT_SEED = 0  # train uses it, val uses seed + 1
_PROMPT = "Repeat '{word}' {times} times."
_PROMPT_RE = re.compile(r"Repeat '([a-z]+)' (\d+) times\.")
# bump when the generator changes: cached files carry it in their name
GENERATOR_VERSION = 1


def make_prompt(word: str, times: int) -> str:
    return _PROMPT.format(word=word, times=times)


def solution(prompt: str) -> str:
    """The correct answer to a task prompt (the user message text)."""
    m = _PROMPT_RE.search(prompt)
    if m is None:
        raise ValueError(f"not a built-in repeat prompt: {prompt!r}")
    return m.group(1) * int(m.group(2))


def sample_task(rng: random.Random) -> tuple[str, int]:
    """(word, times) from the task's distribution."""
    weights = [k ** -TIMES_ALPHA for k in range(1, MAX_TIMES + 1)]
    times = rng.choices(range(1, MAX_TIMES + 1), weights=weights)[0]
    length = min(rng.choice(WORD_LENGTHS), max(1, MAX_ANSWER_CHARS // times))
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length))
    return word, times


def make_row(word: str, times: int, split: str, index: int) -> dict[str, Any]:
    """One dataset row in verl's schema."""
    from verl_async.data.files import verl_row

    extra_info = {"split": split, "index": index, "word": word, "times": times}
    return verl_row(DATA_SOURCE, make_prompt(word, times), word * times, ABILITY, extra_info)


def generate_rows(split: str, num_rows: int, seed: int, exclude: Iterable[str] = ()) -> list[dict[str, Any]]:
    """`num_rows` distinct prompts (none of `exclude`), deterministic in `seed`."""
    rng = random.Random(seed)
    seen = set(exclude)
    rows: list[dict[str, Any]] = []
    while len(rows) < num_rows:
        word, times = sample_task(rng)
        prompt = make_prompt(word, times)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append(make_row(word, times, split, len(rows)))
    return rows


def compute_score(solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> dict[str, float]:
    """1 for the exact answer, partial credit for the right word repeated a wrong number of times."""
    text = solution_str.strip()
    if text == str(ground_truth):
        return {"score": 1.0, "acc": 1.0}
    word = (extra_info or {}).get("word")
    times = (extra_info or {}).get("times")
    score = 0.0
    if word and times and text and len(text) % len(word) == 0 and text == word * (len(text) // len(word)):
        score = 0.5 * max(0.0, 1.0 - abs(len(text) // len(word) - int(times)) / int(times))
    return {"score": score, "acc": 0.0}


def generate_splits(
    train_size: int = SPLIT_SIZES["train"], val_size: int = SPLIT_SIZES["val"], seed: int = DEFAULT_SEED
) -> dict[str, list[dict[str, Any]]]:
    """Train and a held-out val split (val draws with seed + 1 and skips every train prompt)."""
    train = generate_rows("train", train_size, seed)
    val = generate_rows("val", val_size, seed + 1, exclude={r["prompt"][0]["content"] for r in train})
    return {"train": train, "val": val}


# --- builtin:// resolution -------------------------------------------------------------

SCHEME = "builtin://"


def cache_dir() -> str:
    from verl_async.utils.cache import cache_path

    return cache_path("data")


def builtin_path(name: str) -> str:
    """Cached parquet for builtin://NAME, generated (both splits) on first use."""
    from verl_async.data.files import write_rows

    if name not in SPLIT_SIZES:
        raise ValueError(f"unknown built-in dataset {SCHEME}{name}: expected one of {sorted(SPLIT_SIZES)}")
    folder = cache_dir()
    paths = {split: os.path.join(folder, f"repeat_v{GENERATOR_VERSION}_{split}.parquet") for split in SPLIT_SIZES}
    if not all(os.path.exists(p) for p in paths.values()):
        os.makedirs(folder, exist_ok=True)
        for split, rows in generate_splits().items():
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            os.close(fd)
            try:
                write_rows(rows, tmp)
                os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache is plain data
                os.replace(tmp, paths[split])  # atomic: a concurrent first use never sees half a file
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
    return paths[name]
