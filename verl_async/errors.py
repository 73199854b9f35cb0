"""Errors the entry point reports in one line (no traceback)."""


class PipelineError(RuntimeError):
    """One side of the pipeline failed; the message carries the root cause."""
