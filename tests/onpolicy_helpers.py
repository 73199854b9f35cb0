"""Helpers of the true on-policy tests: an engine run, an in-process FSDP2 rank, batches and plans."""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from torch.distributed.fsdp import MixedPrecisionPolicy

from verl_async.config import compose
from verl_async.models.loading import load_causal_lm
from verl_async.protocol import Response, RolloutSample, collate_groups
from verl_async.rollout.engine import GenerateRequest, GenerateResult, SamplingParams
from verl_async.rollout.native import NativeEngine
from verl_async.trainer.batching import LAYOUT_KEYS, plan_update
from verl_async.trainer.common import free_port
from verl_async.trainer.fsdp_worker import FSDPWorker

TEMPERATURE = 0.8
PROMPT_LEN, RESPONSE_LEN = 24, 24
# unequal prompts: batched right-padded prefill, rows joining and leaving the decode batch
PROMPTS = [[5, 9, 30, 41, 7], [100, 3], [17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [250], [64, 65, 66]]


class Bf16CpuWorker(FSDPWorker):
    """The FSDP2 rank with bf16 mixed precision on CPU (what it runs on a GPU; on CPU it runs float32)."""

    def _mp_policy(self):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def requests(prompts: Sequence[Sequence[int]] = PROMPTS, *, max_tokens: int = 18, prefixes=None,
             temperature: float = TEMPERATURE) -> list[GenerateRequest]:
    out = []
    for i, p in enumerate(prompts):
        prefix = prefixes[i] if prefixes else None
        out.append(GenerateRequest(
            f"r{i}", list(p), SamplingParams(temperature=temperature, max_tokens=max_tokens + i, ignore_eos=True, seed=i),
            prefix_token_ids=list(prefix.token_ids) if prefix else [],
            prefix_log_probs=list(prefix.log_probs) if prefix else [],
            prefix_versions=list(prefix.versions) if prefix else []))
    return out


def engine_for(model_dir: str, *, dtype: torch.dtype, true_on_policy: bool, max_num_seqs: int = 3,
               max_model_len: int = PROMPT_LEN + RESPONSE_LEN, device: str = "cpu") -> NativeEngine:
    model = load_causal_lm(model_dir, dtype=dtype, attn_implementation="sdpa", device=torch.device(device))
    return NativeEngine(model=model, device=device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        true_on_policy=true_on_policy)


def run_requests(engine: NativeEngine, reqs: list[GenerateRequest]) -> list[GenerateResult]:
    async def main():
        return await asyncio.wait_for(asyncio.gather(*(engine.generate(r) for r in reqs)), 120)

    results = asyncio.run(main())
    for r in results:
        assert r.error is None, r.error
    return results


def generate(model_dir: str, *, dtype: torch.dtype, true_on_policy: bool, max_num_seqs: int = 3,
             reqs: Optional[list[GenerateRequest]] = None, max_model_len: int = PROMPT_LEN + RESPONSE_LEN,
             device: str = "cpu") -> list[GenerateResult]:
    engine = engine_for(model_dir, dtype=dtype, true_on_policy=true_on_policy, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, device=device)
    try:
        return run_requests(engine, reqs or requests())
    finally:
        engine.close()


def rank(model_dir: str, *overrides: str, true_on_policy: bool, bf16: bool = False, prompt_len: int = PROMPT_LEN,
         response_len: int = RESPONSE_LEN, device: str = "cpu") -> FSDPWorker:
    """An FSDP2 rank in this process (world size 1), initialised; `bf16` on CPU: bf16 mixed precision there too
    (on CUDA the rank runs bf16 anyway)."""
    cfg = compose(overrides=[f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.n=1",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=5",
                             f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
                             f"data.max_prompt_length={prompt_len}", f"data.max_response_length={response_len}",
                             f"actor_rollout_ref.rollout.true_on_policy={true_on_policy}",
                             f"trainer.cpu_threads_per_worker={torch.get_num_threads()}", f"trainer.device={device}",
                             *overrides])
    cls = Bf16CpuWorker if bf16 and device == "cpu" else FSDPWorker
    worker = cls(OmegaConf.to_container(cfg, resolve=True), 0, 1)
    worker.init("127.0.0.1", free_port())
    return worker


def batch_of(prompts: Sequence[Sequence[int]], results: Sequence[GenerateResult],
             loss_masks: Optional[Sequence[Optional[list[int]]]] = None):
    """One group per row (`loss_masks[i]`: multi-turn, 0 on inserted tokens)."""
    masks = loss_masks or [None] * len(results)
    samples = [RolloutSample(uid=f"g{i}", prompt_ids=list(p), data_source="x",
                             responses=[Response(token_ids=r.token_ids, log_probs=r.log_probs, versions=r.versions,
                                                 finish_reason=r.finish_reason, reward=float(i % 2), loss_mask=m)])
               for i, (p, r, m) in enumerate(zip(prompts, results, masks))]
    return collate_groups(samples, pad_token_id=0)


def log_probs(worker: FSDPWorker, batch, micro_batches: list[list[int]]) -> torch.Tensor:
    """compute_log_prob with this micro-batch split, rows back in batch order."""
    out = worker.compute_log_prob(batch, micro_batches)
    result = torch.zeros_like(out["log_probs"])
    result[torch.tensor(out["rows"])] = out["log_probs"]
    return result


def train_step(worker: FSDPWorker, batch, old_log_probs: torch.Tensor, *, micro_size: int = 2) -> dict:
    """One `update` as the worker group drives it (one mini-batch of every row, micro-batches of `micro_size`)."""
    n = batch.batch_size[0]
    send = {k: batch[k] for k in LAYOUT_KEYS}
    send["old_log_probs"] = old_log_probs
    gen = torch.Generator().manual_seed(0)
    send["advantages"] = torch.randn(n, 1, generator=gen) * batch["response_mask"]
    send["loss_mask"] = batch["response_mask"]
    weights = (batch["attention_mask"].sum(-1)).tolist()
    plans = plan_update(batch["group_index"], weights, send["loss_mask"], mini_groups=n, epochs=1, shuffle=False,
                        seed=0, dp=1, dynamic=False, micro_size=micro_size, max_tokens=4096)
    return worker.update(TensorDict(send, batch_size=[n]), plans, ["loss_mask", "old_log_probs", "advantages"])
