"""What travels between the Rollouter and the Trainer.

A `RolloutSample` is the queue's unit: ONE prompt with ALL of its `n` responses
(a GRPO group). It is atomic: the trainer never sees a partial group, so
`RolloutSample.validate(n)` is checked at the put and at the get.

`collate_groups` turns a list of groups into the train batch (a TensorDict with
one row per response), the only shape the trainer's workers see.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # torch and tensordict load where a batch is built (the trainer), not in the queue or the Rollouter
    import torch
    from tensordict import TensorDict

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Response:
    """One sampled response and where each of its tokens came from.

    `log_probs[i]` is log softmax(logits / temperature)[token_ids[i]] under the weights
    of version `versions[i]`: temperature applied, top-k/top-p NOT renormalised, which is
    exactly what the trainer recomputes (see verl_async.algos log-prob helpers).

    A multi-turn response (verl_async.rollout.agent_loop) also holds tokens the model did
    not sample (tool answers, chat-template glue between turns): `loss_mask[i]` is 1 for a
    model token and 0 for such an inserted one, which carries log-prob 0 and version -1
    and gets no gradient, KL, entropy or correction weight. Every token counts toward the
    response length. `loss_mask=None`: all tokens are the model's.
    """

    token_ids: list[int]
    log_probs: list[float]
    versions: list[int]
    finish_reason: str
    reward: float = 0.0
    # Extra reward information (acc, overlong penalty, scorer error ...), numbers only.
    reward_info: dict[str, float] = field(default_factory=dict)
    replica: int = -1
    start_time: float = 0.0
    end_time: float = 0.0
    # How the scheduler produced it (P-DSR: probe, moved, regenerated_tokens), for the lengths log.
    sched: dict[str, float] = field(default_factory=dict)
    loss_mask: Optional[list[int]] = None  # multi-turn: 1 model token, 0 inserted token (see above)
    # What the agent loop reports (num_turns, tool_rewards, rollout_reward_scores, ...): the reward
    # function receives it in extra_info, as verl passes its agent loop's fields.
    agent_info: dict[str, Any] = field(default_factory=dict)
    # On-policy distillation (verl_async/teachers/): the teacher's log-prob of each token (temperature 1), and with
    # a top-k loss its k most likely tokens and their log-probs at each position ([len][k]); None: no teacher.
    teacher_log_probs: Optional[list[float]] = None
    teacher_topk_ids: Optional[list[list[int]]] = None
    teacher_topk_log_probs: Optional[list[list[float]]] = None

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.log_probs) == len(self.versions)):
            raise ValueError(
                f"Response: token_ids ({len(self.token_ids)}), log_probs ({len(self.log_probs)}) and "
                f"versions ({len(self.versions)}) must have the same length"
            )
        if self.loss_mask is not None:
            if len(self.loss_mask) != len(self.token_ids):
                raise ValueError(f"Response: loss_mask ({len(self.loss_mask)}) and token_ids ({len(self.token_ids)}) "
                                 "must have the same length")
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError("Response.loss_mask holds values other than 0 and 1")
        for name in ("teacher_log_probs", "teacher_topk_ids", "teacher_topk_log_probs"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.token_ids):
                raise ValueError(f"Response: {name} ({len(value)}) and token_ids ({len(self.token_ids)}) must have the "
                                 "same length")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Response.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")

    def __len__(self) -> int:
        return len(self.token_ids)

    def _model_versions(self) -> list[int]:
        if self.loss_mask is None:
            return self.versions
        return [v for v, m in zip(self.versions, self.loss_mask) if m]

    @property
    def model_tokens(self) -> int:
        """Tokens the model sampled (the rest were inserted by the agent loop)."""
        return len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def min_version(self) -> int:
        """Oldest weights that sampled one of its tokens (inserted tokens have none); -1 when none did."""
        versions = self._model_versions()
        return min(versions) if versions else -1

    @property
    def max_version(self) -> int:
        versions = self._model_versions()
        return max(versions) if versions else -1


@dataclass
class RolloutSample:
    """One prompt and its complete group of responses."""

    uid: str  # unique per (epoch, dataset row): the exactly-once key
    prompt_ids: list[int]
    responses: list[Response]
    data_source: str = ""
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    index: int = -1  # dataset row
    # Parameter version current at the Rollouter when the group started / was finished.
    param_version_start: int = -1
    param_version_end: int = -1

    @property
    def min_version(self) -> int:
        """Oldest weights that produced any token of the group (staleness is measured from it)."""
        versions = [r.min_version for r in self.responses if r.model_tokens]
        return min(versions) if versions else self.param_version_start

    @property
    def max_version(self) -> int:
        versions = [r.max_version for r in self.responses if r.model_tokens]
        return max(versions) if versions else self.param_version_start

    @property
    def num_tokens(self) -> int:
        return sum(len(self.prompt_ids) + len(r) for r in self.responses)

    def validate(self, n: int) -> "RolloutSample":
        """Refuse partial groups (the P-DSR group-splitting bug must be impossible)."""
        if len(self.responses) != n:
            raise ValueError(f"group {self.uid!r} has {len(self.responses)} responses, expected rollout.n={n}")
        if any(r.finish_reason == "abort" for r in self.responses):
            raise ValueError(f"group {self.uid!r} holds an aborted (unfinished) response")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RolloutSample":
        d = dict(d)
        d["responses"] = [Response(**r) for r in d["responses"]]
        return cls(**d)


def staleness(samples: Sequence[RolloutSample], trainer_version: int) -> list[int]:
    """`trainer_version - min_version` per group (docs/architecture.md "Staleness")."""
    return [trainer_version - s.min_version for s in samples]


def collate_groups(samples: Sequence[RolloutSample], pad_token_id: int) -> "TensorDict":
    """Flatten groups into the train batch: one row per response.

    Keys (B = total responses, P = longest prompt, T = longest response):
      prompts [B,P] left-padded, responses [B,T] right-padded, input_ids [B,P+T],
      attention_mask [B,P+T], position_ids [B,P+T], response_mask [B,T] (float 0/1),
      rollout_log_probs [B,T], token_versions [B,T] (-1 on padding), scores [B],
      group_index [B] (0..G-1, the GRPO group of each row).

    `attention_mask` is the layout: every response token, inserted ones included (the model
    reads tool answers). `response_mask` is the LOSS mask: 0 on padding and on the tokens a
    multi-turn response's loop inserted (`Response.loss_mask`), so the loss, KL, entropy,
    advantages and rollout correction, which all take it, never see a tool token.
    """
    import torch
    from tensordict import TensorDict

    if not samples:
        raise ValueError("collate_groups: no groups given (empty batch)")
    rows = [(g, s, r) for g, s in enumerate(samples) for r in s.responses]
    batch = len(rows)
    max_p = max(len(s.prompt_ids) for _, s, _ in rows)
    max_t = max(1, max(len(r) for _, _, r in rows))
    prompts = torch.full((batch, max_p), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((batch, max_p), dtype=torch.long)
    responses = torch.full((batch, max_t), pad_token_id, dtype=torch.long)
    layout = torch.zeros((batch, max_t), dtype=torch.long)
    response_mask = torch.zeros((batch, max_t), dtype=torch.float32)
    rollout_log_probs = torch.zeros((batch, max_t), dtype=torch.float32)
    token_versions = torch.full((batch, max_t), -1, dtype=torch.long)
    scores = torch.zeros(batch, dtype=torch.float32)
    group_index = torch.zeros(batch, dtype=torch.long)
    for i, (g, s, r) in enumerate(rows):
        p, t = len(s.prompt_ids), len(r)
        if p:
            prompts[i, max_p - p :] = torch.tensor(s.prompt_ids, dtype=torch.long)
            prompt_mask[i, max_p - p :] = 1
        if t:
            responses[i, :t] = torch.tensor(r.token_ids, dtype=torch.long)
            layout[i, :t] = 1
            response_mask[i, :t] = 1.0 if r.loss_mask is None else torch.tensor(r.loss_mask, dtype=torch.float32)
            rollout_log_probs[i, :t] = torch.tensor(r.log_probs, dtype=torch.float32)
            token_versions[i, :t] = torch.tensor(r.versions, dtype=torch.long)
        scores[i] = float(r.reward)
        group_index[i] = g
    attention_mask = torch.cat([prompt_mask, layout], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    teachers = _teacher_tensors([r for _, _, r in rows], max_t)
    return TensorDict(
        {
            **teachers,
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "rollout_log_probs": rollout_log_probs,
            "token_versions": token_versions,
            "scores": scores,
            "group_index": group_index,
        },
        batch_size=[batch],
    )


def _teacher_tensors(responses: Sequence[Response], width: int) -> dict[str, "torch.Tensor"]:
    """`teacher_log_probs` [B, T] and, with top-k, `teacher_topk_ids` / `teacher_topk_log_probs` [B, T, K] (0 on
    padding); {} when no response has a teacher's scores. All responses of a batch have them, or none."""
    import torch

    has = [r.teacher_log_probs is not None for r in responses]
    if not any(has):
        return {}
    if not all(has):
        raise ValueError("collate_groups: some responses carry teacher log-probs and some do not (distillation "
                         "needs them for every response)")
    out = {"teacher_log_probs": torch.zeros((len(responses), width), dtype=torch.float32)}
    for i, r in enumerate(responses):
        if len(r):
            out["teacher_log_probs"][i, : len(r)] = torch.tensor(r.teacher_log_probs, dtype=torch.float32)
    topk = [r.teacher_topk_ids for r in responses]
    if all(t is None for t in topk):
        return out
    ks = {len(row) for r in responses for row in (r.teacher_topk_ids or [])}
    if any(t is None for t in topk) or len(ks) > 1:
        raise ValueError("collate_groups: teacher top-k ids missing on some responses or of different k")
    k = ks.pop() if ks else 1
    out["teacher_topk_ids"] = torch.zeros((len(responses), width, k), dtype=torch.long)
    out["teacher_topk_log_probs"] = torch.zeros((len(responses), width, k), dtype=torch.float32)
    for i, r in enumerate(responses):
        if len(r):
            out["teacher_topk_ids"][i, : len(r)] = torch.tensor(r.teacher_topk_ids, dtype=torch.long)
            out["teacher_topk_log_probs"][i, : len(r)] = torch.tensor(r.teacher_topk_log_probs, dtype=torch.float32)
    return out
