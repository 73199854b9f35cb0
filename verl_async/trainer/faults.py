"""Fault drills on the trainer side (`debug.fail_trainer`, config/fault_specs.py): a process that kills itself.

    rank<R>:die@update<N>[=S]   trainer rank R SIGKILLs itself S s (default 0.05) into the update of step N
    actor:die@sync<V>           the Trainer actor SIGKILLs itself in the sync to version V, once the weights are
                                on the engines and before its checkpoint (generation is paused)

Each entry fires once per run: a marker file under `trainer.default_local_dir/faults/` remembers it,
so the trainer that healing restarts (healing/trainer.py) from an earlier checkpoint does not die
again at the same step. Null (the default): nothing happens.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from typing import Any, Mapping

from verl_async.config.fault_specs import TrainerFault, parse_fail_trainer

FAULT_DIR = "faults"


def kill_this_process() -> None:
    """What `kill -9` of this process does (no cleanup, no exit handlers)."""
    os.kill(os.getpid(), signal.SIGKILL)


def _get(config: Any, group: str, key: str) -> Any:
    section = config.get(group) if isinstance(config, Mapping) or hasattr(config, "get") else None
    return None if section is None else section.get(key)


def _fire_once(config: Any, fault: TrainerFault) -> bool:
    """True the first time `fault` fires in this run (its marker is written before the kill)."""
    folder = os.path.join(str(_get(config, "trainer", "default_local_dir")), FAULT_DIR)
    os.makedirs(folder, exist_ok=True)
    marker = os.path.join(folder, re.sub(r"[^A-Za-z0-9_.@-]", "_", fault.entry) + ".fired")
    try:
        with open(marker, "x") as f:
            f.write(str(os.getpid()))
    except FileExistsError:
        return False
    return True


def _faults(config: Any) -> list[TrainerFault]:
    value = _get(config, "debug", "fail_trainer")
    return parse_fail_trainer(list(value) if value is not None and not isinstance(value, str) else value)


def die_in_sync(config: Any, version: int) -> None:
    """The Trainer actor's `actor:die@sync<V>`: dies here, in the sync to `version`."""
    for fault in _faults(config):
        if fault.who == "actor" and fault.at == int(version) and _fire_once(config, fault):
            kill_this_process()


def die_in_update(config: Any, rank: int, step: int) -> None:
    """A trainer rank's `rank<R>:die@update<N>`: dies `seconds` into the update of `step` (a timer: mid-update)."""
    for fault in _faults(config):
        if fault.rank == int(rank) and fault.at == int(step) and _fire_once(config, fault):
            timer = threading.Timer(fault.seconds, kill_this_process)
            timer.daemon = True
            timer.start()
