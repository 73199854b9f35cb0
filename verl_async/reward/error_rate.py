"""Stop a run whose reward function fails instead of scoring: a broken scorer is a setup error.

A scorer that raises, returns a non-number or a non-finite value, dies or passes
`reward_model.timeout_s` scores 0 for that response. A few such responses are noise (a
pathological model output); many are a broken function, and a run that goes on trains on
zero reward and reports an accuracy of 0. `ErrorWindow` keeps the last
`reward_model.error_window` scored responses; when more than
`floor(reward_model.max_error_rate * error_window)` of them failed, the reward manager raises
`RewardFunctionError`, one line naming the function, the error and a sample input. With the
defaults (0.1 of 200) a function that always fails stops the run at its 21st response;
`max_error_rate=1.0` turns the check off.
"""

from __future__ import annotations

import collections
import math
from typing import Any


class RewardFunctionError(RuntimeError):
    """The reward function failed on too many responses: the run stops instead of training on zeros."""


class ErrorWindow:
    """Failed / scored over the last `window` responses; `record` says when the failures pass the limit."""

    def __init__(self, max_error_rate: float, window: int) -> None:
        if not 0.0 <= max_error_rate <= 1.0:
            raise ValueError(f"reward_model.max_error_rate must be in [0, 1], got {max_error_rate}")
        if window < 1:
            raise ValueError(f"reward_model.error_window must be >= 1, got {window}")
        self.max_error_rate = float(max_error_rate)
        self.window = int(window)
        # the most failures the window may hold (the epsilon keeps 0.29 * 100 at 29, not 28.999...)
        self.max_errors = math.floor(self.max_error_rate * self.window + 1e-9)
        self._recent: collections.deque[bool] = collections.deque(maxlen=self.window)
        self.errors = 0  # failures among the responses in the window

    def record(self, failed: bool) -> bool:
        """One scored response. True when the window now holds more than `max_errors` failures."""
        if len(self._recent) == self.window:
            self.errors -= self._recent[0]
        self._recent.append(bool(failed))
        self.errors += bool(failed)
        return self.errors > self.max_errors

    def __len__(self) -> int:
        return len(self._recent)


def _one_line(text: str, limit: int) -> str:
    """repr of the first `limit` characters: newlines and quotes escaped, so the message stays one line."""
    return repr(text[:limit]) + (f" ({len(text)} chars)" if len(text) > limit else "")


def too_many_failures(
    window: ErrorWindow, function: str, error: str, data_source: str, ground_truth: Any, solution_str: str
) -> RewardFunctionError:
    """The error that stops the run, with the failure that tripped the check as the sample."""
    error = " ".join(str(error).split())
    return RewardFunctionError(
        f"reward function {function} failed on {window.errors} of the last {len(window)} scored responses "
        f"(more than reward_model.max_error_rate={window.max_error_rate:g} of reward_model.error_window="
        f"{window.window}): {error}; sample input: data_source={data_source!r}, "
        f"ground_truth={_one_line(str(ground_truth), 100)}, solution_str={_one_line(solution_str, 200)}; fix the "
        f"function, or raise reward_model.max_error_rate (1.0 turns this check off)"
    )
