"""A teacher: an HF causal LM that scores the student's samples (one forward pass, no generation).

For a sequence prompt + response it returns, per response token, the teacher's log-prob of that token
(log_softmax of the logits at temperature 1, float32: verl's `prompt_logprobs` of the teacher server,
which ignores temperature) and, with `topk`, the teacher's k most likely tokens there and their
log-probs (verl's top-k `prompt_logprobs`). Sequences are left-padded in batches of at most
`max_num_seqs` sequences and `max_num_batched_tokens` padded tokens, and only the response positions'
logits are computed (`logits_to_keep`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from verl_async.utils.microbatch import chunks


@dataclass(frozen=True)
class TeacherRequest:
    token_ids: tuple[int, ...]  # prompt + response
    response_start: int  # index of the first response token (>= 1: a prompt token precedes it)

    def __post_init__(self) -> None:
        if not 1 <= self.response_start <= len(self.token_ids):
            raise ValueError(f"TeacherRequest: response_start {self.response_start} outside 1..{len(self.token_ids)}")


@dataclass
class TeacherOutput:
    log_probs: torch.Tensor  # [R] float32: the teacher's log-prob of each response token
    topk_ids: Optional[torch.Tensor] = None  # [R, K] int64
    topk_log_probs: Optional[torch.Tensor] = None  # [R, K] float32


def response_log_probs(logits: torch.Tensor, tokens: torch.Tensor, topk: Optional[int]) -> TeacherOutput:
    """`logits` [R, V] predicting `tokens` [R] (the response): the teacher's outputs for them (float32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = TeacherOutput(log_probs=logp.gather(-1, tokens.to(logp.device).long().unsqueeze(-1)).squeeze(-1).cpu())
    if topk:
        values, ids = logp.topk(min(int(topk), logp.shape[-1]), dim=-1)
        out.topk_ids, out.topk_log_probs = ids.cpu(), values.cpu()
    return out


class TeacherModel:
    def __init__(self, model_path: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 topk: Optional[int] = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 8192,
                 trust_remote_code: bool = False) -> None:
        from verl_async.models.builtin import resolve_model_path
        from verl_async.models.loading import load_causal_lm

        self.device = torch.device(device)
        self.model = load_causal_lm(resolve_model_path(model_path), dtype=dtype, trust_remote_code=trust_remote_code,
                                    device=self.device).eval()
        self.vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self.topk, self.max_num_seqs, self.max_tokens = topk, max_num_seqs, max_num_batched_tokens
        self.pad_id = 0

    @torch.no_grad()
    def score(self, requests: Sequence[TeacherRequest]) -> list[TeacherOutput]:
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].token_ids))
        out: list[Optional[TeacherOutput]] = [None] * len(requests)
        lengths = [len(requests[i].token_ids) for i in order]
        for run in chunks(lengths, self.max_num_seqs, self.max_tokens):
            picked = [requests[order[j]] for j in run]
            for j, result in zip(run, self._score_batch(picked)):
                out[order[j]] = result
        return out  # type: ignore[return-value]

    def _score_batch(self, requests: Sequence[TeacherRequest]) -> list[TeacherOutput]:
        for r in requests:
            bad = [t for t in r.token_ids if not 0 <= t < self.vocab]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the teacher's vocabulary of {self.vocab}: a teacher "
                                 "must share the student's tokenizer")
        width = max(len(r.token_ids) for r in requests)
        keep = max(len(r.token_ids) - r.response_start for r in requests) + 1
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding: every sequence ends in the last column
            ids[i, width - len(r.token_ids):] = torch.tensor(r.token_ids, dtype=torch.long)
            mask[i, width - len(r.token_ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                            position_ids=positions.to(self.device), logits_to_keep=keep, use_cache=False).logits
        results = []
        for i, r in enumerate(requests):
            n = len(r.token_ids) - r.response_start  # response tokens; column -1 predicts nothing
            rows = logits[i, keep - 1 - n: keep - 1]
            results.append(response_log_probs(rows, torch.tensor(r.token_ids[r.response_start:]), self.topk))
        return results
