"""The end of a run says what healed: one line per engine replica restart and per trainer restart, and totals."""

from __future__ import annotations

from typing import Any, Sequence


def heal_summary(replica_events: Sequence[dict[str, Any]], trainer_restarts: Sequence[dict[str, Any]] = ()
                 ) -> dict[str, float]:
    """Prints what healed (rollout/healing.py `HealEvent`s, healing/trainer.py `TrainerRestart`s); returns fault/* totals
    for the run's summary ({} when nothing happened)."""
    out: dict[str, float] = {}
    for e in replica_events:
        where = f"engine replica {e['replica']} was lost ({e['cause']})"
        if e["outcome"] == "rejoined":
            print(f"healed: {where}; restarted in {e['restarted_s']:.1f} s, rejoined {e['rejoined_s']:.1f} s after the "
                  f"loss" + ("" if e.get("version") is None else f" with the weights of version {e['version']}"),
                  flush=True)
        elif e["outcome"] in ("restarting", "awaiting weights"):
            print(f"warning: {where} and had not rejoined when the run ended ({e['outcome']})", flush=True)
        # retired: the "taken out of rotation" line says it; "lost again": a later event follows it
    if replica_events:
        rejoined = [e["rejoined_s"] for e in replica_events if e.get("rejoined_s") is not None]
        out["fault/replica_restarts"] = float(sum(e.get("restarted_s") is not None for e in replica_events))
        out["fault/replicas_retired"] = float(sum(e["outcome"] == "retired" for e in replica_events))
        if rejoined:
            out["fault/replica_rejoin_s_max"] = float(max(rejoined))
    for r in trainer_restarts:
        source = r["checkpoint"] or "the model the run started with"
        print(f"healed: the trainer died ({r['cause']}); restarted from {source} at step {r['step']}, generation "
              f"resumed {r['recovery_s']:.1f} s after the death, {r['groups_back']} group(s) back to the queue",
              flush=True)
    if trainer_restarts:
        out["fault/trainer_restarts"] = float(len(trainer_restarts))
        out["fault/trainer_recovery_s_max"] = float(max(r["recovery_s"] for r in trainer_restarts))
    return out
