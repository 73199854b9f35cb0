"""Request bookkeeping and admission for the native engine (plain Python, no tensors).

Admission policy: a request runs only when a KV slot is free (slots = min(max_num_seqs,
kv_cache_tokens // max_model_len), each slot holds max_model_len tokens), so every admitted
request can always finish: reserving prompt + max_tokens up front is what makes the engine
never run out of KV memory mid-run (no preemption needed). The price of contiguous slots is
that a short request still reserves a whole slot; the waste is bounded by the slot length,
which RL rollouts set to prompt_length + response_length anyway. Requests beyond the budget
wait in FIFO order. A prefill batch is limited by `max_num_batched_tokens` padded tokens (a
single longer prompt still runs alone).

Running sequences occupy slots 0..B-1 in order; when some finish, the last ones move into
the holes (`finish()` returns the moves), so the decode batch is always a prefix of the cache.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from verl_async.rollout.engine import GenerateRequest, GenerateResult


@dataclass
class Sequence:
    request: GenerateRequest
    deliver: Callable[[GenerateResult], None]
    stop_ids: frozenset[int]
    max_total_len: int  # prompt + prefix + generated may not exceed this (the slot length)
    generator: Optional[torch.Generator] = None
    token_ids: list[int] = field(default_factory=list)  # whole response: prefix + new
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    slot: int = -1
    cache_len: int = 0  # tokens whose K/V are in the slot
    finish_reason: Optional[str] = None
    error: Optional[str] = None

    def __post_init__(self) -> None:
        req = self.request
        self.token_ids = list(req.prefix_token_ids)
        self.log_probs = list(req.prefix_log_probs)
        self.versions = list(req.prefix_versions)
        # response length at which the sequence ends: max_tokens or a full slot, whichever comes first
        self._length_limit = min(req.sampling.max_tokens, self.max_total_len - len(req.prompt_ids))

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def context(self) -> list[int]:
        """What prefill runs: the prompt and any response prefix being continued."""
        return list(self.request.prompt_ids) + self.token_ids

    @property
    def total_len(self) -> int:
        return len(self.request.prompt_ids) + len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def check_finished(self) -> Optional[str]:
        """Finish reason implied by the tokens so far (stop token, max_tokens, context full), or None."""
        if self.token_ids and self.token_ids[-1] in self.stop_ids:
            return "stop"
        if len(self.token_ids) >= self.request.sampling.max_tokens or self.total_len >= self.max_total_len:
            return "length"
        return None

    def append(self, token: int, log_prob: float, version: int) -> bool:
        """Add one sampled token; True if the sequence is now finished (what check_finished says, without its walk)."""
        self.token_ids.append(token)
        self.log_probs.append(log_prob)
        self.versions.append(version)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self._length_limit:
            self.finish_reason = "length"
        else:
            self.finish_reason = None
            return False
        return True

    def result(self) -> GenerateResult:
        return GenerateResult(
            request_id=self.request_id,
            token_ids=list(self.token_ids),
            log_probs=list(self.log_probs),
            versions=list(self.versions),
            finish_reason=self.finish_reason or "abort",
            error=self.error,
        )


class Scheduler:
    def __init__(self, *, num_slots: int, max_num_batched_tokens: int) -> None:
        if num_slots < 1:
            raise ValueError(f"native engine: need at least one KV slot, got {num_slots}")
        self.num_slots = num_slots
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # running[i].slot == i
        self.by_id: dict[str, Sequence] = {}
        self.peak_running = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots (FIFO) within the prefill token budget."""
        admitted: list[Sequence] = []
        width = 0
        while self.waiting and len(self.running) < self.num_slots:
            seq = self.waiting[0]
            new_width = max(width, len(seq.context))
            if admitted and new_width * (len(admitted) + 1) > self.max_num_batched_tokens:
                break
            self.waiting.popleft()
            width = new_width
            seq.slot = len(self.running)
            self.running.append(seq)
            admitted.append(seq)
        self.peak_running = max(self.peak_running, len(self.running))
        return admitted

    def finish(self) -> tuple[list[Sequence], list[int], list[int]]:
        """Drop done sequences; return (finished, move sources, move destinations) for compaction."""
        finished = [s for s in self.running if s.done]
        waiting_done = [s for s in self.waiting if s.done]
        if waiting_done:
            self.waiting = collections.deque(s for s in self.waiting if not s.done)
        if not finished:
            for seq in waiting_done:
                self.by_id.pop(seq.request_id, None)
            return waiting_done, [], []
        keep = [s for s in self.running if not s.done]
        holes = sorted(s.slot for s in finished if s.slot < len(keep))
        movers = [s for s in keep if s.slot >= len(keep)]
        src, dst = [], []
        for seq, hole in zip(movers, holes):
            src.append(seq.slot)
            dst.append(hole)
            seq.slot = hole
        self.running = sorted(keep, key=lambda s: s.slot)
        for seq in finished + waiting_done:
            seq.slot = -1
            self.by_id.pop(seq.request_id, None)
        return finished + waiting_done, src, dst
