"""What a checkpoint keeps of the responses in flight, so that a resume continues them instead of regenerating.

A checkpoint is written while generation is paused for a sync (trainer.py): with partial rollout
every request in flight was aborted and came back with its tokens, so each response of a group
in flight is then either finished, partial (tokens, log-probs, per-token versions), or not
started. `PartialLog` is the Rollouter's record of that, per prompt uid and response index; the
checkpoint stores it with each pending prompt (`PromptTask.resume`), and after a restart (by
hand, or of the whole run) the Rollouter continues each response from there: a finished one is
used as it is, a partial one is the prefix of its next request, so its tokens keep the log-probs
and versions that sampled them and their staleness counts as it would have.

A multi-turn trajectory (rollout/agent_loop.py) is kept up to the last complete turn with its
loss mask and turn counters (`agent`), plus the tokens of the turn under way (model tokens,
mask 1); its tool instances are not kept (a tool with state starts afresh).

An entry is a `Response` as a dict (`dataclasses.asdict`) plus, for a trajectory, `turn_start`
(where the turn under way began) and `agent` (its counters at the last complete turn).
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, Optional

from verl_async.protocol import Response

_RESPONSE_FIELDS = {f.name for f in fields(Response)}


def entry(response: Response, **extra: Any) -> dict:
    out = asdict(response)
    out.update(extra)
    return out


def response_of(saved: dict) -> Response:
    return Response(**{k: v for k, v in saved.items() if k in _RESPONSE_FIELDS})


def model_tokens(saved: Optional[dict]) -> int:
    """Tokens of `saved` the model sampled (what continuing it saves generating again)."""
    if not saved:
        return 0
    mask = saved.get("loss_mask")
    return len(saved["token_ids"]) if mask is None else int(sum(mask))


def finished(saved: dict, max_tokens: int) -> bool:
    """A response that needs no more tokens: it stopped, or reached `max_tokens` (a trajectory: it ended)."""
    if saved.get("agent") is not None or saved["finish_reason"] == "abort":
        return False
    return saved["finish_reason"] == "stop" or len(saved["token_ids"]) >= max_tokens or bool(saved.get("agent_info"))


class PartialLog:
    """Per prompt uid and response index: the latest known state of each response of a group in flight."""

    def __init__(self) -> None:
        self._log: dict[str, dict[int, dict]] = {}

    def note(self, uid: str, i: int, saved: dict) -> None:
        self._log.setdefault(uid, {})[int(i)] = saved

    def note_tokens(self, uid: str, i: int, response: Response) -> None:
        """A request of response `i` came back (aborted by a sync, or done). In a trajectory, the tokens past the
        turn's start are the turn under way: model tokens, loss mask 1, counters as at the turn's start."""
        before = self._log.get(uid, {}).get(int(i))
        if before is None or before.get("turn_start") is None:
            self.note(uid, i, entry(response))
            return
        start = int(before["turn_start"])
        mask = list(before["loss_mask"] or [])[:start] + [1] * (len(response.token_ids) - start)
        self.note(uid, i, {**entry(response), "loss_mask": mask, "turn_start": start, "agent": before["agent"]})

    def get(self, uid: str) -> dict[int, dict]:
        return dict(self._log.get(uid, {}))

    def drop(self, uid: str) -> None:
        self._log.pop(uid, None)

    def to_resume(self, uid: str, unconsumed: Optional[dict] = None) -> dict[str, dict]:
        """The `PromptTask.resume` a checkpoint stores for `uid`: what is known now, over what a resume left unused."""
        out = dict(unconsumed or {})
        out.update({str(i): saved for i, saved in self._log.get(uid, {}).items()})
        return out
