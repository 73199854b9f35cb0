"""The vLLM engine (`actor_rollout_ref.rollout.name=vllm`): vLLM v1 `AsyncLLM` behind InferenceEngine.

One engine = one replica on `tensor_model_parallel_size` GPUs (the replica actor owns them;
vLLM's EngineCore and its workers run in child processes). Importing this module does not
import vLLM; starting the engine does (through `verl_async.optional`, which names the key and
the install line when vLLM is missing).

Log-probs. vLLM runs with `logprobs_mode="processed_logprobs"` and every request asks for
`logprobs=0` (the sampled token only): the value is `log_softmax(logits / T)` in float32,
computed after temperature (greedy requests: T=1), which is our convention and what the
trainer recomputes with the same temperature (`rollout.temperature`; 1 for greedy
`do_sample=false` rollouts: `algos.logprob_temperature`) (the raw default would report T=1
log-probs for a T!=1 sample: verl issue #6240). One difference, documented in RESULTS.md:
with top-k / top-p active vLLM's processed log-probs are renormalised over the kept tokens
(`log p - log(kept mass)`, >= our value); with top_k=-1 and top_p=1 (the RL default) they
are identical. `processed_logprobs` also turns off FlashInfer sampling (PyTorch sampler).

Partial rollout. `abort()` aborts in-flight requests; vLLM delivers a final output with
finish_reason "abort" holding every token (and log-prob) sampled so far, returned after the
request's prefix. A continued request sends prompt + prefix as the prompt and the remaining
budget as `max_tokens`.

Weights. `update_weights` (object-store transport) sends each bucket of host tensors to the
workers through `collective_rpc`; the collective transports make every worker a sync-group
member (verl_async/sync/collective.py drives them through `call_workers`, the workers run
`vllm_worker.py`). Both load with the
model's own `load_weights` (HF names; TP sharding and q/k/v, gate/up stacking are vLLM's).
After a load, the prefix cache is reset when `free_cache_engine` is true (the default): KV
computed by the old weights is never reused (fully async engines keep their KV memory; this
is what the key means here). vLLM reports a reset it could not do (False: blocks still held
by a request); the reset is retried briefly, then the load fails with `PrefixCacheResetError`
and the engine keeps its old version, rather than serve continuations from stale KV.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Any, Iterable, Mapping, Optional, Sequence

from verl_async.optional import VLLM, require
from verl_async.rollout.engine import EngineStats, GenerateRequest, GenerateResult, InferenceEngine, SamplingParams
from verl_async.rollout.native.sizing import DEFAULT_MAX_NUM_SEQS

logger = logging.getLogger("verl_async.vllm")

WORKER_EXTENSION = "verl_async.rollout.vllm_worker.WeightSyncWorkerExtension"
_RATE_WINDOW_S = 5.0
# Waits between prefix-cache reset attempts: an abort frees its KV blocks a scheduler step later.
PREFIX_RESET_RETRY_S = (0.05, 0.2, 0.5, 1.0)


class PrefixCacheResetError(RuntimeError):
    """vLLM could not reset its prefix cache after a weight load: its KV may be the old weights'."""


async def reset_prefix_cache(llm: Any, version: int, retry_s: Optional[Sequence[float]] = None) -> None:
    """Reset vLLM's prefix cache after loading weights `version`, or raise PrefixCacheResetError.

    vLLM's `reset_prefix_cache()` returns False when it could not reset (some KV blocks
    still in use) and True when it did; releases that return None cannot say, which is
    logged once.
    """
    retry_s = PREFIX_RESET_RETRY_S if retry_s is None else retry_s
    for wait in (*retry_s, None):
        ok = await llm.reset_prefix_cache()
        if ok is None:
            if not getattr(reset_prefix_cache, "_warned", False):
                reset_prefix_cache._warned = True  # type: ignore[attr-defined]
                logger.warning("this vLLM's reset_prefix_cache() reports no result: a failed reset cannot be detected")
            return
        if ok:
            return
        if wait is None:
            break
        logger.warning("vLLM could not reset its prefix cache after loading weights v%d (KV blocks in use); "
                       "retrying in %.2fs", version, wait)
        await asyncio.sleep(wait)
    raise PrefixCacheResetError(
        f"vLLM could not reset its prefix cache after loading weights v{version} ({len(retry_s) + 1} attempts): "
        "continued requests could reuse KV computed under the old weights; a request still held KV blocks "
        "during the weight sync"
    )


def engine_args_from_config(rollout_cfg: Mapping[str, Any], *, model_path: str, trust_remote_code: bool = False,
                            override_config: Optional[Mapping[str, Any]] = None, **overrides: Any) -> dict[str, Any]:
    """`AsyncEngineArgs` keyword arguments from the verl rollout keys (+ `engine_kwargs.vllm`, + overrides)."""
    get = rollout_cfg.get
    max_model_len = get("max_model_len")
    if not max_model_len and get("prompt_length") and get("response_length"):
        max_model_len = int(get("prompt_length")) + int(get("response_length"))
    tp = int(get("tensor_model_parallel_size", 1) or 1)
    kwargs: dict[str, Any] = {
        "model": model_path,
        "skip_tokenizer_init": True,  # token ids in, token ids out; EOS comes as stop_token_ids
        "generation_config": "vllm",  # never take sampling defaults from the checkpoint
        "dtype": str(get("dtype", "bfloat16")),
        "tensor_parallel_size": tp,
        "distributed_executor_backend": "mp" if tp > 1 else "uni",
        "gpu_memory_utilization": float(get("gpu_memory_utilization", 0.5)),
        "max_num_seqs": int(get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS),  # null: 64 (vLLM sizes its KV cache itself)
        "max_num_batched_tokens": int(get("max_num_batched_tokens", 8192)),
        "enable_chunked_prefill": bool(get("enable_chunked_prefill", True)),
        "enable_prefix_caching": bool(get("enable_prefix_caching", True)),
        "enforce_eager": bool(get("enforce_eager", False)),
        "seed": int(get("seed", 0) or 0),
        "load_format": str(get("load_format", "auto")),
        "disable_log_stats": bool(get("disable_log_stats", True)),
        "trust_remote_code": bool(trust_remote_code),
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if max_model_len:
        kwargs["max_model_len"] = int(max_model_len)
    if override_config:
        kwargs["hf_overrides"] = dict(override_config)
    vllm_kwargs = (get("engine_kwargs") or {}).get("vllm") or {}
    kwargs.update({str(k): _plain(v) for k, v in vllm_kwargs.items()})
    kwargs.update(overrides)
    if kwargs.get("max_num_batched_tokens") and kwargs.get("max_model_len") and not kwargs["enable_chunked_prefill"]:
        # without chunked prefill one step must hold a whole prompt
        kwargs["max_num_batched_tokens"] = max(int(kwargs["max_num_batched_tokens"]), int(kwargs["max_model_len"]))
    return kwargs


def _plain(value: Any) -> Any:
    """OmegaConf containers (engine_kwargs.vllm from Hydra) as plain dicts/lists: vLLM validates with pydantic."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def vllm_sampling_kwargs(sampling: SamplingParams, remaining: int) -> dict[str, Any]:
    """vLLM SamplingParams keywords for one request: `remaining` new tokens at most, log-prob of the sampled token."""
    return {
        "n": 1,
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k) if sampling.top_k and sampling.top_k > 0 else 0,
        "max_tokens": int(remaining),
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": bool(sampling.ignore_eos),
        "seed": sampling.seed,
        "logprobs": 0,
        "flat_logprobs": True,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def sampled_logprobs(logprobs: Any, token_ids: Sequence[int]) -> list[float]:
    """The sampled token's log-prob per position, from vLLM's FlatLogprobs or list-of-dicts."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (logprobs=0 was requested)")
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs
        out = []
        for pos, tok in enumerate(token_ids):
            lo, hi = logprobs.start_indices[pos], logprobs.end_indices[pos]
            ids = logprobs.token_ids[lo:hi]
            out.append(float(logprobs.logprobs[lo + ids.index(tok)]))
        return out
    return [float(pos[tok].logprob) for pos, tok in zip(logprobs, token_ids)]


class VLLMEngine(InferenceEngine):
    """vLLM AsyncLLM as an InferenceEngine; see the module docstring."""

    name = "vllm"

    def __init__(self, engine_kwargs: Mapping[str, Any], *, free_cache_engine: bool = True, version: int = 0,
                 sync_timeout_s: float = 600.0) -> None:
        self.engine_kwargs = dict(engine_kwargs)
        self.tensor_parallel_size = int(self.engine_kwargs.get("tensor_parallel_size", 1))
        self.free_cache_engine = bool(free_cache_engine)
        self.sync_timeout_s = float(sync_timeout_s)
        self.llm: Any = None
        self.max_model_len = 0
        self._start_lock: Optional[asyncio.Lock] = None
        self._version = int(version)
        self._paused = False
        self._active: dict[str, int] = {}  # request id -> tokens before this call (prefix)
        self._generated = 0
        self._events: collections.deque[tuple[float, int]] = collections.deque()

    async def start(self) -> "VLLMEngine":
        """Build vLLM's AsyncLLM inside the running event loop (its output handler and ZMQ sockets live there).

        Called by the replica actor before it reports ready; every other async method calls it too.
        """
        if self.llm is not None:
            return self
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self.llm is None:
                os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA is live in this process
                engine_args = require(VLLM, "vllm.engine.arg_utils").AsyncEngineArgs(**self.engine_kwargs)
                llm = require(VLLM, "vllm.v1.engine.async_llm").AsyncLLM.from_engine_args(engine_args)
                self.max_model_len = int(llm.vllm_config.model_config.max_model_len)
                self.llm = llm
        return self

    @classmethod
    def from_config(cls, rollout_cfg: Mapping[str, Any], *, model_path: str, device: str = "cuda",
                    trust_remote_code: bool = False, override_config: Optional[Mapping[str, Any]] = None,
                    **overrides: Any) -> "VLLMEngine":
        if not str(device).startswith("cuda"):
            raise ValueError(f"actor_rollout_ref.rollout.name=vllm needs trainer.device=cuda, got device {device!r}")
        kwargs = engine_args_from_config(rollout_cfg, model_path=model_path, trust_remote_code=trust_remote_code,
                                         override_config=override_config, **overrides)
        return cls(kwargs, free_cache_engine=bool(rollout_cfg.get("free_cache_engine", True)))

    # ------------------------------------------------------------------ generation
    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await self.start()  # vLLM is importable from here on (or start() said what to install)
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sampling = request.sampling
        prefix = list(request.prefix_token_ids)
        done = self._finished_already(request)
        if done is not None:
            return self._result(request, [], [], done)
        remaining = sampling.max_tokens - len(prefix)
        prompt = list(request.prompt_ids) + prefix
        if len(prompt) + 1 > self.max_model_len:
            return self._result(request, [], [], "length", error=(
                f"prompt + prefix = {len(prompt)} tokens leave no room in max_model_len={self.max_model_len}"))
        remaining = min(remaining, self.max_model_len - len(prompt))
        try:
            sp = VSamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **vllm_sampling_kwargs(sampling, remaining))
        except ValueError as exc:
            return self._result(request, [], [], "abort", error=f"bad sampling parameters: {exc}")
        version = self._version
        self._active[request.request_id] = len(prefix)
        final = None
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt), sp, request.request_id):
                final = out
        except ValueError as exc:  # vLLM rejected the request; the engine keeps serving
            return self._result(request, [], [], "abort", error=str(exc))
        finally:
            self._active.pop(request.request_id, None)
        if final is None or not final.outputs:
            return self._result(request, [], [], "abort")
        comp = final.outputs[0]
        tokens = list(comp.token_ids)
        logps = sampled_logprobs(comp.logprobs, tokens) if tokens else []
        reason = str(comp.finish_reason or "abort")
        self._note_tokens(len(tokens))
        return self._result(request, tokens, logps, reason if reason in ("stop", "length", "abort") else "stop",
                            version=version)

    def _finished_already(self, request: GenerateRequest) -> Optional[str]:
        """A continued prefix that already ended (stop token or budget) needs no generation."""
        prefix, sampling = request.prefix_token_ids, request.sampling
        if not prefix:
            return None
        if prefix[-1] in set(sampling.stop_token_ids):  # like the native engine: stop ids apply even with ignore_eos
            return "stop"
        if len(prefix) >= sampling.max_tokens:
            return "length"
        return None

    def _result(self, request: GenerateRequest, tokens: list[int], logps: list[float], reason: str, *,
                version: Optional[int] = None, error: Optional[str] = None) -> GenerateResult:
        v = self._version if version is None else version
        return GenerateResult(
            request_id=request.request_id,
            token_ids=list(request.prefix_token_ids) + tokens,
            log_probs=list(request.prefix_log_probs) + logps,
            versions=list(request.prefix_versions) + [v] * len(tokens),
            finish_reason=reason,
            error=error,
        )

    def _note_tokens(self, n: int) -> None:
        now = time.monotonic()
        self._generated += n
        self._events.append((now, n))
        while self._events and now - self._events[0][0] > _RATE_WINDOW_S:
            self._events.popleft()

    async def abort(self, request_ids: Optional[Sequence[str]] = None) -> None:
        ids = list(self._active) if request_ids is None else [r for r in request_ids if r in self._active]
        if ids and self.llm is not None:
            await self.llm.abort(ids)

    async def pause(self) -> None:
        await self.start()
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        self._paused = True

    async def resume(self) -> None:
        await self.start()
        await self.llm.resume_generation()
        self._paused = False

    # ------------------------------------------------------------------ weights
    async def after_load(self, version: int) -> None:
        """After every load: new tokens carry `version`; the prefix cache (old weights' KV) is reset first."""
        if self.free_cache_engine:
            await reset_prefix_cache(self.llm, int(version))  # raises: the version stays the old one
        self._version = int(version)

    async def update_weights(self, named_tensors: Iterable[Any], version: int) -> None:
        """Object-store path: each bucket (pairs or dict) goes to every worker via collective_rpc."""
        from verl_async.rollout.native.weights import _as_bucket
        from verl_async.rollout.vllm_worker import pack_tensor

        for index, item in enumerate(named_tensors):
            bucket = [(name, *pack_tensor(t)) for name, t in _as_bucket(item, index)]
            await self.call_workers("verl_async_load_bucket", bucket)
        await self.after_load(version)

    @property
    def worker_ranks(self) -> int:
        """Processes that hold the weights (one per tensor-parallel rank): each joins a collective sync group."""
        return self.tensor_parallel_size

    async def call_workers(self, method: str, *args: Any, timeout: Optional[float] = None) -> list:
        """`method` of rollout/vllm_worker.py on every worker (vLLM's collective_rpc); results in rank order."""
        await self.start()
        return await self.llm.collective_rpc(method, timeout=self.sync_timeout_s if timeout is None else timeout,
                                             args=tuple(args))

    # ------------------------------------------------------------------ misc
    def stats(self) -> EngineStats:
        now = time.monotonic()
        recent = sum(n for t, n in self._events if now - t <= _RATE_WINDOW_S)
        return EngineStats(running=len(self._active), waiting=0, tokens_per_s=recent / _RATE_WINDOW_S,
                           generated_tokens=self._generated, version=self._version, paused=self._paused)

    async def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

