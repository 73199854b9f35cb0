"""What the fault-drill keys say: `debug.fail_replicas` (engine replicas) and `debug.fail_trainer` (trainer).

Pure parsing, shared by the config check (one line naming the key and the entry) and the code
that injects the faults (rollout/faults.py, trainer/faults.py).

debug.fail_replicas, one entry per fault (null: none):

    all | [0, 2]            every request of those replicas answers with an error (a broken engine)
    INDEX:KIND[@N][=SECONDS]  KIND: error | die | crash | hang | slow (INDEX may be `all`)
        die@N    the replica SIGKILLs its own process in the middle of its Nth request (first life only)
        crash@N  the same in every life (restarted, it dies again: it ends retired)
        hang@N   its Nth request never answers, not even to an abort (first life only)
        slow=S   every request from the Nth on waits S seconds before it runs (every life)
        =S on die/crash: how long inside the request before the kill (default 0.05 s)

debug.fail_trainer (null: none), each entry fires once per run (a marker under
trainer.default_local_dir/faults/ remembers it across restarts):

    rank<R>:die@update<N>[=S]   trainer rank R SIGKILLs itself S s (default 0.05) into the update of step N
    actor:die@sync<V>           the Trainer actor SIGKILLs itself during the sync to version V, once the weights
                                reached the engines and before its checkpoint
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

REPLICA_KINDS = ("error", "die", "crash", "hang", "slow")
FIRST_LIFE_ONLY = ("die", "hang")  # a restarted replica serves: the drill is its healing
_REPLICA_ENTRY = re.compile(r"^(all|\d+)(?::(\w+))?(?:@(\d+))?(?:=([0-9.]+))?(?:@(\d+))?$")
_TRAINER_ENTRY = re.compile(r"^(actor|rank\d+):die@(update|sync)(\d+)(?:=([0-9.]+))?$")

FailReplicas = Optional[Union[str, Sequence[Union[int, str]]]]


class FaultSpecError(ValueError):
    """A fault-drill entry that does not parse; `key` is the config key, the message names the entry."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")


@dataclass(frozen=True)
class Fault:
    """One replica fault: `kind` from the `at`th request of a life on (`seconds`: slow's delay, die's wait)."""

    kind: str
    at: int = 1
    seconds: float = 0.05

    def applies(self, life: int) -> bool:
        return life == 0 or self.kind not in FIRST_LIFE_ONLY


def parse_fail_replicas(value: FailReplicas, replicas: Optional[int] = None) -> dict[str, list[Fault]]:
    """{"all" | "<index>": [Fault, ...]} from debug.fail_replicas (`replicas`: indices must be below it)."""
    key = "debug.fail_replicas"
    if value is None:
        return {}
    if isinstance(value, str):
        if value != "all":
            raise FaultSpecError(key, f"expected null, all or a list of entries such as [0] or ['0:die@3'], "
                                      f"got {value!r}")
        return {"all": [Fault("error")]}
    if not isinstance(value, Sequence) and not hasattr(value, "__iter__"):
        raise FaultSpecError(key, f"expected null, all or a list of entries such as [0] or ['0:die@3'], got {value!r}")
    out: dict[str, list[Fault]] = {}
    for entry in value:
        if isinstance(entry, bool) or not isinstance(entry, (int, str)):
            raise FaultSpecError(key, f"{entry!r} is neither a replica index nor an INDEX:KIND entry")
        text = str(entry).strip()
        match = _REPLICA_ENTRY.match(text)
        if match is None:
            raise FaultSpecError(key, f"cannot read {text!r}; expected INDEX:KIND[@N][=SECONDS] with KIND in "
                                      f"{', '.join(REPLICA_KINDS)} (e.g. 0:die@3, 1:slow=0.5)")
        who, kind, at, seconds, at_after = match.groups()
        kind = kind or "error"
        if kind not in REPLICA_KINDS:
            raise FaultSpecError(key, f"{text!r}: unknown kind {kind!r}; available: {', '.join(REPLICA_KINDS)}")
        if who != "all" and replicas is not None and not 0 <= int(who) < replicas:
            raise FaultSpecError(key, f"replica {who} does not exist: this run has {replicas} engine replica(s), "
                                      f"indices 0..{replicas - 1}")
        n = int(at or at_after or 1)
        if n < 1:
            raise FaultSpecError(key, f"{text!r}: @N counts requests from 1")
        out.setdefault(who, []).append(Fault(kind, n, float(seconds) if seconds else 0.05))
    return out


def replica_faults(index: int, value: FailReplicas, life: int = 0) -> list[Fault]:
    """The faults debug.fail_replicas puts on replica `index` in its `life` (0: first start, 1: first restart ...)."""
    table = parse_fail_replicas(value)
    return [f for f in table.get("all", []) + table.get(str(index), []) if f.applies(life)]


@dataclass(frozen=True)
class TrainerFault:
    """One debug.fail_trainer entry: `who` ("actor" | "rank<R>") dies at `when` ("update" | "sync") number `at`."""

    entry: str
    who: str
    when: str
    at: int
    seconds: float = 0.05

    @property
    def rank(self) -> Optional[int]:
        return int(self.who[4:]) if self.who.startswith("rank") else None


def parse_fail_trainer(value: Any, world_size: Optional[int] = None) -> list[TrainerFault]:
    """debug.fail_trainer's entries (`world_size`: trainer ranks must exist)."""
    key = "debug.fail_trainer"
    if value is None:
        return []
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        value = [value]
    out = []
    for entry in value:
        text = str(entry).strip()
        match = _TRAINER_ENTRY.match(text)
        if match is None:
            raise FaultSpecError(key, f"cannot read {text!r}; expected rank<R>:die@update<N>[=SECONDS] or "
                                      "actor:die@sync<V>")
        who, when, at, seconds = match.groups()
        if (who == "actor") != (when == "sync"):
            raise FaultSpecError(key, f"{text!r}: a rank dies in an update (rank<R>:die@update<N>), the actor in a "
                                      "sync (actor:die@sync<V>)")
        fault = TrainerFault(text, who, when, int(at), float(seconds) if seconds else 0.05)
        if fault.rank is not None and world_size is not None and fault.rank >= world_size:
            raise FaultSpecError(key, f"{text!r}: trainer rank {fault.rank} does not exist (the trainer has "
                                      f"{world_size} rank(s))")
        if fault.at < 1:
            raise FaultSpecError(key, f"{text!r}: steps and versions count from 1")
        out.append(fault)
    return out
