"""The one error type config validation raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is unknown, of the wrong type or inconsistent.

    `str(err)` is a single line, "<full.key>: <reason>", meant to be shown to the user
    as is (the entry point prints it and exits with status 2, no traceback).
    """

    def __init__(self, key: str, reason: str):
        self.key = key
        self.reason = " ".join(str(reason).split())  # always one line
        super().__init__(f"{key}: {self.reason}")
