"""Folders that several nodes must see as one, checked at start-up with a marker file.

The driver writes a marker of its own (a fresh name per run, so concurrent runs sharing a
cache never disturb each other) into each folder; every actor, on whatever node it landed,
looks for it. A node that mounts another disk at that path (or none) fails here, in one line
naming the config key and the node, instead of writing checkpoints nobody reads back.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

MARKER_DIR = ".verl_async_nodes"
README_SECTION = 'docs/cluster.md'


class SharedDirError(RuntimeError):
    """A node does not see a folder the run needs shared; the message is one line naming the key and the node."""


@dataclass(frozen=True)
class SharedDir:
    key: str  # what the user sets to move it: a config key or an environment variable
    path: str  # absolute, as the driver sees it
    marker: str  # the driver's marker file, inside `path`


def mark(folders: Mapping[str, str]) -> list[SharedDir]:
    """Driver: write one marker per folder (creating the folder) and return what actors check."""
    token = uuid.uuid4().hex
    out = []
    for key, path in folders.items():
        marker = os.path.join(path, MARKER_DIR, token)
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "w") as f:
            f.write(token)
        out.append(SharedDir(key, path, marker))
    return out


def unmark(dirs: Iterable[SharedDir]) -> None:
    """Driver, at the end of the run: remove its markers (and the marker folder when it is empty)."""
    for d in dirs:
        try:
            os.remove(d.marker)
            os.rmdir(os.path.dirname(d.marker))
        except OSError:  # gone already, or another run's markers are still there
            pass


def problem(dirs: Sequence[SharedDir], where: str) -> Optional[str]:
    """Why `where` (this process's node) cannot run its part, or None when it sees every folder."""
    for d in dirs:
        if not os.path.isfile(d.marker):
            return (f"{d.key}: {where} does not see {d.path} as the driver does (the driver's marker "
                    f"{os.path.relpath(d.marker, d.path)} is not there); every node of the run must mount it at the "
                    f"same path ({README_SECTION})")
    return None


def node_name() -> str:
    """This process's Ray node, as a message names it: its address and the start of its id."""
    import ray

    return f"node {ray.util.get_node_ip_address()} (id {ray.get_runtime_context().get_node_id()[:8]})"


def problem_here(dirs: Sequence[SharedDir], who: str) -> Optional[str]:
    """`problem` on this process's node; `who` says what runs here ("the trainer's bundle 1")."""
    return problem(dirs, f"{node_name()}, where {who} runs,") if dirs else None


def verify_here(dirs: Sequence[SharedDir], who: str) -> None:
    """Raise SharedDirError when this node lacks one of `dirs` (an actor's first act)."""
    found = problem_here(dirs, who)
    if found:
        raise SharedDirError(found)
