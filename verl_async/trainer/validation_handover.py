"""Validations across a trainer restart: none lost, none logged twice, none of weights the checkpoint lost."""

from __future__ import annotations

from typing import Any, Optional, Sequence


def restart_validations(cancelled: Optional[int], finished: Sequence[dict[str, Any]], restored_version: int,
                        due: bool) -> tuple[list[dict[str, Any]], bool]:
    """What the new trainer logs of the validations the dead one left, and whether it validates `restored_version`
    again.

    `finished`: outcomes that ended without the dead trainer taking them; those of versions after the checkpoint
    validated weights that are gone (the restored run validates those versions again when it gets there), the others
    are logged. `cancelled`: the version whose validation was cancelled with the death (None: none ran). It runs
    again only when it is the restored version and validation is due there (`due`); an older one cannot be running
    (a sync settles the validation before moving weights), a newer one comes again with its version.
    """
    keep = [o for o in finished if int(o["version"]) <= restored_version]
    return keep, bool(due and cancelled is not None and int(cancelled) == restored_version)
