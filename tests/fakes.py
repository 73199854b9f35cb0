"""A real InferenceEngine without a model: random-length responses with per-token delays.

Used by the pipeline invariant tests (group atomicity, staleness, partial rollout) to
drive the Rollouter's real scheduling code with random engine delays, fast.
"""

from __future__ import annotations

import asyncio
import random
from typing import Callable, Iterable, Optional, Sequence

import torch

from verl_async.rollout.engine import EngineStats, GenerateRequest, GenerateResult, InferenceEngine


class FakeEngine(InferenceEngine):
    """`fail_every=k`: every k-th request fails; `fail_when(request)`: requests it picks fail (fault injection)."""

    def __init__(
        self,
        *,
        max_len: int = 12,
        token_delay: float = 0.001,
        seed: int = 0,
        fail_every: int = 0,
        fail_when: Optional[Callable[[GenerateRequest], bool]] = None,
        error: str = "injected failure",
        seeded: bool = False,
    ) -> None:
        self.max_len = max_len
        self.token_delay = token_delay
        self.rng = random.Random(seed)
        self._version = 0
        self._running: dict[str, asyncio.Event] = {}
        self._paused = asyncio.Event()
        self._paused.set()
        self.fail_every = fail_every
        self.fail_when = fail_when
        self.seeded = seeded  # True: a seeded request's length comes from its seed (same seed, same response)
        self.error = error
        self.calls = 0
        self.seeds: list[Optional[int]] = []  # sampling seed of every request, in order
        self.weights: dict[str, torch.Tensor] = {}
        self.generated = 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.calls += 1
        self.seeds.append(request.sampling.seed)
        if (self.fail_every and self.calls % self.fail_every == 0) or (self.fail_when and self.fail_when(request)):
            await asyncio.sleep(0)
            return GenerateResult(request.request_id, [], [], [], "abort", error=self.error)
        abort = asyncio.Event()
        self._running[request.request_id] = abort
        tokens = list(request.prefix_token_ids)
        logps = list(request.prefix_log_probs)
        versions = list(request.prefix_versions)
        rng = random.Random(request.sampling.seed) if self.seeded and request.sampling.seed is not None else self.rng
        target = rng.randint(1, self.max_len)
        if request.sampling.ignore_eos:  # run to max_tokens (scripted lengths: verl_async.rollout.scripted)
            target = 1 << 30
        try:
            while True:
                if len(tokens) >= request.sampling.max_tokens:
                    reason = "length"
                    break
                if len(tokens) >= target:
                    reason = "stop"
                    break
                await self._paused.wait()
                await asyncio.sleep(self.token_delay * self.rng.random() * 2)
                if abort.is_set():
                    reason = "abort"
                    break
                tokens.append(len(tokens) % 7 + 1)
                logps.append(-0.5)
                versions.append(self._version)
                self.generated += 1
        finally:
            self._running.pop(request.request_id, None)
        return GenerateResult(request.request_id, tokens, logps, versions, reason)

    async def abort(self, request_ids: Optional[Sequence[str]] = None) -> None:
        for rid, ev in list(self._running.items()):
            if request_ids is None or rid in request_ids:
                ev.set()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        for name, t in named_tensors:
            self.weights[name] = t
        self._version = version

    async def pause(self) -> None:
        self._paused.clear()

    async def resume(self) -> None:
        self._paused.set()

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._running), version=self._version)

    @property
    def version(self) -> int:
        return self._version


def install_fake_vllm(monkeypatch, async_llm_cls: Optional[type], version: str = "0.0-fake") -> dict:
    """Stand-ins for the vLLM modules `VLLMEngine` imports (vLLM 0.26 paths), AsyncLLM = `async_llm_cls`.

    `async_llm_cls=None` makes `vllm.v1.engine.async_llm` unimportable. Returns the modules.
    """
    import enum
    import sys
    from types import ModuleType

    class EngineArgs:
        def __init__(self, **kw):
            self.kwargs = kw

    class VllmSamplingParams:
        def __init__(self, output_kind=None, **kw):
            self.kw, self.output_kind = kw, output_kind

    names = ("vllm", "vllm.inputs", "vllm.sampling_params", "vllm.engine", "vllm.engine.arg_utils", "vllm.v1",
             "vllm.v1.engine", "vllm.v1.engine.async_llm")
    mods = {name: ModuleType(name) for name in names}
    mods["vllm"].__version__ = version
    mods["vllm"].SamplingParams = VllmSamplingParams
    mods["vllm.inputs"].TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    mods["vllm.sampling_params"].RequestOutputKind = enum.Enum("RequestOutputKind", "CUMULATIVE DELTA FINAL_ONLY")
    mods["vllm.engine.arg_utils"].AsyncEngineArgs = EngineArgs
    mods["vllm.v1.engine.async_llm"].AsyncLLM = async_llm_cls
    if async_llm_cls is None:
        mods["vllm.v1.engine.async_llm"] = None  # the import fails
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods


class ListSource:
    """PromptTasks in order, as the Rollouter's prompt source."""

    def __init__(self, items):
        self.items, self.pos = list(items), 0

    def next(self):
        self.pos += 1
        return self.items[self.pos - 1] if self.pos <= len(self.items) else None

    def push_front(self, items):
        self.items[self.pos:self.pos] = list(items)

    def state_dict(self):
        return {}


class ListSink:
    """Collects the groups the Rollouter puts."""

    def __init__(self):
        self.groups = []

    async def put(self, sample):
        self.groups.append(sample)

    async def size(self):
        return 0


async def no_score(item, responses):
    return [(0.0, {}) for _ in responses]
