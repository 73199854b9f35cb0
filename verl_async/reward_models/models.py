"""The reward models themselves, each in a replica (a Ray actor, or the plain class in-process):

* `ClassifierReplica`: an HF `AutoModelForSequenceClassification` scoring token-id inputs in batches (right-padded,
  at most `max_num_seqs` inputs and `max_num_batched_tokens` padded tokens a forward); the score is the last
  label's logit at the last input token;
* the judge runs on engine replicas (verl_async/rollout/replica.py) like the policy's, with its own weights,
  which no weight sync reaches (rollout/side_models.py starts them).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from verl_async.utils.replica_plan import ReplicaPlan
from verl_async.utils.microbatch import MicroBatcher, chunks


class ClassifierModel:
    def __init__(self, model_path: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 8192, trust_remote_code: bool = False) -> None:
        from transformers import AutoModelForSequenceClassification

        from verl_async.models.builtin import resolve_model_path

        self.device = torch.device(device)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            resolve_model_path(model_path), dtype=dtype, trust_remote_code=trust_remote_code).to(self.device).eval()
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad if pad is not None else 0)
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens

    @torch.no_grad()
    def score(self, inputs: Sequence[Sequence[int]]) -> list[float]:
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        out: list[Optional[float]] = [None] * len(inputs)
        for run in chunks([len(inputs[i]) for i in order], self.max_num_seqs, self.max_tokens):
            rows = [list(inputs[order[j]]) for j in run]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
                mask[i, : len(r)] = 1
            logits = self._logits(ids.to(self.device), mask.to(self.device), [len(r) for r in rows])
            for j, value in zip(run, logits[:, -1].float().tolist()):
                out[order[j]] = value
        return out  # type: ignore[return-value]

    def _logits(self, ids: torch.Tensor, mask: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Logits at each row's last real token: the head over the base model's last hidden state there (the
        pad id may be a real token of the input, so HF's pooling by pad id is not trusted)."""
        base = getattr(self.model, self.model.base_model_prefix)
        hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(lengths), device=hidden.device), torch.tensor(lengths, device=hidden.device) - 1]
        head = getattr(self.model, "score", None) or getattr(self.model, "classifier")
        return head(last)


class ClassifierReplica:
    """One classifier on one device, answering single inputs in batches (the plain class behind the actor)."""

    def __init__(self, model_path: str, plan: ReplicaPlan, *, dtype: str = "float32", max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 8192, trust_remote_code: bool = False) -> None:
        device = plan.enter()
        self.model = ClassifierModel(model_path, device=str(device), dtype=plan.dtype(dtype), max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens, trust_remote_code=trust_remote_code)
        self.batcher: MicroBatcher[Sequence[int], float] = MicroBatcher(
            self.model.score, max_items=max_num_seqs, max_tokens=max_num_batched_tokens, cost=len)

    async def score(self, input_ids: Sequence[int]) -> float:
        return await self.batcher.submit(list(input_ids))

    def ready(self) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {"batches": self.batcher.batches, "inputs": self.batcher.items}
