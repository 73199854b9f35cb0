"""Which scorer answers for a `data_source`, and how a custom scorer is found.

Every scorer here returns a dict with at least `score` (the reward) and `acc`
(1.0 when the answer is right); `to_score_dict` brings any scorer's return value
(a number of any numeric type: bool, int, float, numpy scalar, 0-d tensor; or a dict
with `score`) to that shape, so reward managers see one format.

`bounded` marks scorers whose cost is linear in a clipped input (gsm8k, the
built-in task): they run inline. The others (math: sympy; code: test cases run in the
code sandbox; custom: unknown code) run in the reward sandbox with a time limit.
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from verl_async.utils.pyfile import import_file


class UnknownDataSourceError(ValueError):
    """No scorer is registered for a data_source: a setup error, never scored 0 silently."""


@dataclass(frozen=True)
class ScorerSpec:
    name: str
    fn: Callable[[str, Any, Optional[dict]], dict]
    bounded: bool


def _gsm8k(solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, method: str = "strict") -> dict:
    from verl_async.reward import gsm8k

    score = gsm8k.compute_score(solution_str, str(ground_truth), method=method)
    return {"score": score, "acc": float(score == 1.0)}


def _math(solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> dict:
    from verl_async.reward import math_answer

    score = math_answer.compute_score(solution_str, str(ground_truth))
    return {"score": score, "acc": score}


def _math_dapo(solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> dict:
    from verl_async.reward import math_dapo

    return math_dapo.compute_score(solution_str, str(ground_truth))


def _code(solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, **options: Any) -> dict:
    """Test cases run in the sandbox (reward/code_score.py); `options` from reward.sandbox_fusion."""
    from verl_async.reward import code_score

    return code_score.compute_score(solution_str, ground_truth, extra_info, **options)


def _builtin(solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> dict:
    from verl_async.data import builtin

    return builtin.compute_score(solution_str, ground_truth, extra_info)


_GSM8K = ScorerSpec("gsm8k", _gsm8k, bounded=True)
_MATH = ScorerSpec("math", _math, bounded=False)
_DAPO = ScorerSpec("math_dapo", _math_dapo, bounded=True)
_BUILTIN = ScorerSpec("builtin", _builtin, bounded=True)
_CODE = ScorerSpec("code", _code, bounded=False)

SCORERS: dict[str, ScorerSpec] = {
    "openai/gsm8k": _GSM8K,
    "verl_async/arithmetic": _GSM8K,  # data_preprocess/arithmetic.py
    "lighteval/MATH": _MATH,
    "DigitalLearningGmbH/MATH-lighteval": _MATH,
    "HuggingFaceH4/MATH-500": _MATH,
    "math_dapo": _DAPO,
    # verl's code-execution sources (prime_code / sandbox_fusion): test cases in reward_model.ground_truth
    "codecontests": _CODE,
    "apps": _CODE,
    "codeforces": _CODE,
    "taco": _CODE,
}
# data_source prefixes (verl: "aime*" is scored like math_dapo)
PREFIX_SCORERS: dict[str, ScorerSpec] = {"aime": _DAPO, "verl_async/builtin": _BUILTIN}


def resolve_scorer(data_source: str) -> ScorerSpec:
    if data_source in SCORERS:
        return SCORERS[data_source]
    for prefix, spec in PREFIX_SCORERS.items():
        if str(data_source).startswith(prefix):
            return spec
    known = sorted(SCORERS) + [p + "*" for p in PREFIX_SCORERS]
    raise UnknownDataSourceError(
        f"no reward function for data_source={data_source!r} (known: {', '.join(known)}); "
        f"set custom_reward_function.path/name to score it"
    )


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, **options: Any
) -> dict:
    """verl's dispatch: score `solution_str` with the scorer registered for `data_source`.

    `options` are that scorer's settings from the config (e.g. gsm8k's `method`).
    """
    return resolve_scorer(data_source).fn(solution_str, ground_truth, extra_info, **options)


def as_number(value: Any) -> float:
    """float(value) for a real number of any numeric type, as verl takes it (it calls float()).

    bool, int, float, numpy scalars (`np.float32(1.0)`, what numpy-based scorers return),
    0-d numpy arrays and 0-d tensors are numbers; strings, containers and arrays with more
    than one element are not (float("1.0") would parse text, and a scorer that returns
    text is broken).
    """
    if isinstance(value, (str, bytes, complex)) or getattr(value, "ndim", 0) != 0:
        raise TypeError(f"scorer returned {_describe(value)}, expected a number or a dict with 'score'")
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"scorer returned {_describe(value)}, expected a number or a dict with 'score'") from exc


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__}" + (f" of shape {tuple(shape)}" if shape is not None and len(shape) else "")


def _number_or_none(value: Any) -> Optional[float]:
    try:
        return as_number(value)
    except TypeError:
        return None


def to_score_dict(raw: Any) -> dict[str, float]:
    """A scorer's return value as {"score", "acc", other numeric extras}; raise on nonsense.

    A bare number (see `as_number`) is the score; `acc` defaults to `score > 0`. Non-numeric
    extras (e.g. the predicted string) are dropped: reward info travels as numbers. A
    non-finite score raises: it is a scorer failure, counted as one (never a reward).
    """
    if isinstance(raw, dict):
        if "score" not in raw:
            raise ValueError(f"scorer returned a dict without 'score' (keys: {sorted(map(str, raw))})")
        out = {str(k): v for k, v in ((k, _number_or_none(v)) for k, v in raw.items()) if v is not None}
        out["score"] = as_number(raw["score"])
    else:
        out = {"score": as_number(raw)}
    if not math.isfinite(out["score"]):
        raise ValueError(f"scorer returned a non-finite score {out['score']}")
    out.setdefault("acc", float(out["score"] > 0))
    return out


@dataclass(frozen=True)
class FunctionRef:
    """A picklable pointer to a function: an importable module or a .py file, plus a name.

    Sandbox workers load it themselves (functions from a file loaded by path cannot
    be pickled by reference).
    """

    name: str
    module: Optional[str] = None
    path: Optional[str] = None

    @property
    def label(self) -> str:
        """`file.py:name` or `module:name`, for messages."""
        return f"{self.path or self.module}:{self.name}"

    def load(self) -> Callable:
        key = (self.module, self.path, self.name)
        fn = _LOADED.get(key)
        if fn is None:
            mod = importlib.import_module(self.module) if self.module else import_file(self.path or "")
            fn = getattr(mod, self.name)
            _LOADED[key] = fn
        return fn


_LOADED: dict[tuple, Callable] = {}


def custom_scorer_ref(path: Optional[str], name: Optional[str]) -> Optional[FunctionRef]:
    """Check `custom_reward_function.path/name` here, in the caller, and return a reference.

    None when no custom scorer is configured. Errors name the config key.
    """
    if not path:
        return None
    full = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(full):
        raise FileNotFoundError(f"custom_reward_function.path={path!r}: no such file")
    if not name:
        raise ValueError(
            f"custom_reward_function.name is missing: name the function in {path!r} that computes the score"
        )
    try:
        module = import_file(full)
    except Exception as exc:
        raise ImportError(f"custom_reward_function.path={path!r}: importing it failed: {exc!r}") from exc
    if not callable(getattr(module, str(name), None)):
        raise AttributeError(f"custom_reward_function.name={name!r}: no function of that name in {path!r}")
    return FunctionRef(name=str(name), path=full)
