"""Errors the entry point reports in one line (no traceback)."""


class PipelineError(RuntimeError):
    """One side of the pipeline failed; the message carries the root cause."""


def root_cause(exc: BaseException) -> str:
    """`Type: message` of the innermost cause of a Ray task error (the exception the remote code raised)."""
    cause = getattr(exc, "cause", None)
    while getattr(cause, "cause", None) is not None:
        cause = cause.cause
    return f"{type(cause or exc).__name__}: {cause or exc}"
