"""Errors the entry point reports in one line (no traceback)."""


class PipelineError(RuntimeError):
    """One side of the pipeline failed; the message carries the root cause."""


def innermost_cause(exc: BaseException) -> BaseException:
    """The exception the remote code raised, under the Ray task errors that carry it (`.cause`)."""
    while getattr(exc, "cause", None) is not None:
        exc = exc.cause
    return exc


def root_cause(exc: BaseException) -> str:
    """`Type: message` of the innermost cause of a Ray task error."""
    cause = innermost_cause(exc)
    return f"{type(cause).__name__}: {cause}"
