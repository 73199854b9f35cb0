"""Errors the entry point reports in one line (no traceback)."""

import re

# The last line of a Python traceback: "package.module.SomeError: message".
_RAISED = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception)): (.+)$", re.M)


class PipelineError(RuntimeError):
    """One side of the pipeline failed; the message carries the root cause."""


class ReplicaLost(RuntimeError):
    """The engine replica behind a proxy is gone: its process died, was restarted, or its node went away.

    Raised by an engine proxy (rollout/replica.py `RemoteEngine`) instead of Ray's actor errors, so the
    Rollouter moves the request to another replica and has this one healed (rollout/healing.py), and a
    weight sync's fan-out (sync/ports.py) can leave it out. `restarted`: the replica answered, but from a
    new process that holds no current weights yet.
    """

    def __init__(self, index: int, reason: str, restarted: bool = False) -> None:
        super().__init__(f"engine replica {index} lost: {reason}")
        self.index = index
        self.reason = reason
        self.restarted = restarted


def innermost_cause(exc: BaseException) -> BaseException:
    """The exception the remote code raised, under the Ray task errors that carry it (`.cause`)."""
    while getattr(exc, "cause", None) is not None:
        exc = exc.cause
    return exc


def root_cause(exc: BaseException) -> str:
    """`Type: message` of the innermost cause of a Ray task error.

    An actor whose `__init__` raised reaches the caller as ActorDiedError holding only the text of
    the traceback(s) (nested when that `__init__` started actors that failed the same way); its
    last `Type: message` line is the cause.
    """
    cause = innermost_cause(exc)
    if getattr(cause, "actor_init_failed", False):
        raised = _RAISED.findall(str(cause))
        if raised:
            name, message = raised[-1]
            return f"{name}: {message}"
    return f"{type(cause).__name__}: {cause}"
