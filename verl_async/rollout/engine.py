"""The inference-engine interface the Rollouter drives.

Engines are asyncio objects living inside the Rollouter's process (or its engine
replica actors). Implementations: `native` (torch, CPU/CUDA/NPU) and `vllm`.

Log-prob convention (binding for every engine and the trainer): the log-prob of a
sampled token is `log_softmax(logits / temperature)[token]`, computed in float32 from
the model's logits; top-k / top-p filtering only restricts what may be sampled and
is NOT renormalised into the reported log-prob. Greedy (temperature 0, what
`rollout.do_sample=false` sends) reports `log_softmax(logits)` (temperature 1). The
trainer recomputes exactly this (`verl_async.algos.logprob_temperature`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

FinishReason = str  # "stop" | "length" | "abort"


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    max_tokens: int = 256  # budget for the WHOLE response, prefix included
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: Optional[int] = None

    def validate(self) -> "SamplingParams":
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        return self


@dataclass
class GenerateRequest:
    """A prompt, optionally with a partial response to continue.

    A continued request carries the prefix's tokens, log-probs and versions; they are
    returned unchanged at the front of the result so every token keeps the version
    that sampled it.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prefix_token_ids: list[int] = field(default_factory=list)
    prefix_log_probs: list[float] = field(default_factory=list)
    prefix_versions: list[int] = field(default_factory=list)


@dataclass
class GenerateResult:
    request_id: str
    token_ids: list[int]  # the whole response (prefix + new)
    log_probs: list[float]
    versions: list[int]
    finish_reason: FinishReason  # stop | length | abort
    error: Optional[str] = None  # set when the request itself was bad; the engine keeps serving

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    tokens_per_s: float = 0.0
    kv_used_tokens: int = 0
    kv_budget_tokens: int = 0
    generated_tokens: int = 0
    version: int = -1
    paused: bool = False

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_budget_tokens if self.kv_budget_tokens else 0.0


class InferenceEngine(abc.ABC):
    """Async generation with abort, pause/resume and in-place weight refit."""

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    @abc.abstractmethod
    async def abort(self, request_ids: Optional[Sequence[str]] = None) -> None:
        """Abort the given requests (None = all); they return promptly with finish_reason 'abort'."""

    @abc.abstractmethod
    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named tensors chunk by chunk; afterwards new tokens carry `version`."""

    @abc.abstractmethod
    async def pause(self) -> None: ...

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    async def stats_async(self) -> EngineStats:
        """stats() for a caller on an event loop (a replica actor's proxy awaits the actor instead of blocking)."""
        return self.stats()

    @property
    @abc.abstractmethod
    def version(self) -> int: ...

    async def shutdown(self) -> None:  # pragma: no cover - default no-op
        return None


class DelegatingEngine(InferenceEngine):
    """An engine around `inner` that passes every call through; wrappers override `generate` only."""

    def __init__(self, inner: InferenceEngine) -> None:
        self.inner = inner

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self.inner.generate(request)

    async def abort(self, request_ids: Optional[Sequence[str]] = None) -> None:
        await self.inner.abort(request_ids)

    async def update_weights(self, named_tensors: Iterable, version: int) -> None:
        await self.inner.update_weights(named_tensors, version)

    async def pause(self) -> None:
        await self.inner.pause()

    async def resume(self) -> None:
        await self.inner.resume()

    def stats(self) -> EngineStats:
        return self.inner.stats()

    async def stats_async(self) -> EngineStats:
        return await self.inner.stats_async()

    @property
    def version(self) -> int:
        return self.inner.version

    async def shutdown(self) -> None:
        await self.inner.shutdown()
