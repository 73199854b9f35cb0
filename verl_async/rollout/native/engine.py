"""The native engine: continuous batching on the trainer's own HF model class (CPU / CUDA / NPU).

Why not transformers' continuous batching (`generate_batch`, `init_continuous_batching`,
`ContinuousBatchingManager`, transformers 5.23, read from the installed source)? It has a
paged cache, a background thread, `cancel_request` and a `pause()` context for in-place
updates, but it fails three of our needs:
- log-probs: `return_logprobs` reports `log(softmax(processed scores))` after the
  top-k/top-p processors, i.e. renormalised over the filtered set (our convention: not
  renormalised) and via log(softmax) rather than log_softmax;
- sampling: `do_sample` is one setting for the whole manager (no greedy and sampled
  requests side by side) and `torch.multinomial` runs without a generator (no per-request
  seed, results depend on batch composition);
- abort: `cancel_request` drops the request state and frees its blocks without delivering
  its partial output, which partial rollout needs to continue the response later.
It is also an experimental API that changes between releases. So this engine is a small
scheduler of its own over the unmodified HF model: HF attention layers write into a
contiguous per-slot KV cache (kv_cache.SlotKVCache) through the one `Cache.update` hook
and get explicit 4D masks, so the numbers are the trainer's (CPU float32: within 1e-6).

Threading: the engine lives in an asyncio process (Rollouter / replica actor) but forward
passes block, so one worker thread owns the model, the cache and the scheduler and runs
the step loop; every call from the event loop (`generate`, `abort`, `pause`, `resume`,
`update_weights`, `shutdown`) is a command the worker executes between two steps, and
results go back with `loop.call_soon_threadsafe`. A failing step fails the requests in that
step (GenerateResult.error) and the engine keeps serving the rest.

One step: admit waiting requests into free slots and prefill them as one right-padded
batch (their first token is sampled from the prefill logits), then one decode step for all
running sequences, then retire finished ones (compacting slots) and deliver their results.
A token is stamped with the weight version current when it was sampled.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import math
import queue
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence as Seq

import torch

from verl_async.config.derived import rollout_max_model_len
from verl_async.invariant import attention_span, environment_problem
from verl_async.rollout.engine import EngineStats, GenerateRequest, GenerateResult, InferenceEngine
from verl_async.rollout.native.requests import rejected, request_problem
from verl_async.rollout.native.runner import ModelRunner, model_geometry
from verl_async.rollout.native.sampler import SamplingPlan, sample_with_plan
from verl_async.rollout.native.scheduler import Scheduler, Sequence
from verl_async.rollout.native.sizing import DEFAULT_MAX_NUM_SEQS, auto_slots, kv_bytes_per_token
from verl_async.rollout.native.weights import WeightLoader
from verl_async.utils import device as device_lib

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_RATE_WINDOW_S = 5.0


def parse_dtype(dtype: Any) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"native engine: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[key]


def _deliver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: GenerateResult) -> None:
    """Hand a result from the worker thread to the caller's event loop."""

    def settle() -> None:
        if not fut.done():
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
        pass


class NativeEngine(InferenceEngine):
    """Continuous-batching torch engine; see the module docstring for the design.

    Sizing: `max_model_len` (default: the model's max_position_embeddings; from_config uses
    prompt_length + response_length) is the slot length, the most tokens prompt + response may
    hold; `kv_cache_tokens` (default max_num_seqs * max_model_len) is the KV budget, allocated
    up front as min(max_num_seqs, kv_cache_tokens // max_model_len) slots; requests beyond it
    wait. `max_num_batched_tokens` caps one prefill batch (padded tokens).
    Device: "cpu" | "cuda" | "npu" (through verl_async.utils.device; NPU untested here), dtype
    float32 on CPU and bf16 on accelerators unless given. `cuda_graphs` (default on for CUDA)
    replays decode steps per (batch, KV-length bucket of `kv_len_bucket` tokens);
    `compile_decode` adds torch.compile (opt-in); `fast_decode` (default on) decodes supported
    models with fewer kernels (runner.py). `check_finite_weights` rejects NaN/Inf in update_weights.
    `true_on_policy` (actor_rollout_ref.rollout.true_on_policy): the model runs the trainer's
    batch-invariant kernels (verl_async.invariant; the model is patched in place) and reports the
    log-prob the trainer recomputes, bit for bit; fast_decode then means invariant_decode.py, compile_decode refused.
    """

    name = "native"

    def __init__(
        self,
        model_path: Optional[str] = None,
        *,
        model: Optional[torch.nn.Module] = None,
        device: str | device_lib.DeviceSpec = "cpu",
        dtype: Any = None,
        max_num_seqs: Optional[int] = DEFAULT_MAX_NUM_SEQS,
        max_model_len: Optional[int] = None,
        kv_cache_tokens: Optional[int] = None,
        max_num_batched_tokens: int = 8192,
        seed: int = 0,
        eos_token_ids: Optional[Seq[int]] = None,
        trust_remote_code: bool = False,
        override_config: Optional[Mapping[str, Any]] = None,
        attn_implementation: str = "sdpa",
        cuda_graphs: Optional[bool] = None,
        kv_len_bucket: int = 256,
        compile_decode: bool = False,
        fast_decode: bool = True,
        version: int = 0,
        check_finite_weights: bool = True,
        true_on_policy: bool = False,
        gpu_memory_utilization: float = 0.5,
    ) -> None:
        self._spec = device if isinstance(device, device_lib.DeviceSpec) else device_lib.resolve(device)
        if true_on_policy:
            problem = environment_problem(self._spec.kind)
            if problem is not None:
                raise RuntimeError(problem)
        loading = time.time()
        if model is None:
            if model_path is None:
                raise ValueError("native engine: give model_path (HF id or folder) or a loaded model")
            model = self._load(model_path, parse_dtype(dtype), trust_remote_code, override_config, attn_implementation)
        loaded = time.time()
        model.eval().requires_grad_(False)
        self._model = model
        config = model.config
        limit = getattr(config, "max_position_embeddings", None)
        self.max_model_len = int(max_model_len or limit or 4096)
        if limit and self.max_model_len > limit:
            logger.warning("native engine: max_model_len %d exceeds max_position_embeddings %d", self.max_model_len, limit)
        if max_num_seqs is None:  # sized: from kv_cache_tokens, from free memory on CUDA (sizing.py), else 64
            max_num_seqs = self._auto_max_num_seqs(model, kv_cache_tokens, gpu_memory_utilization)
        if max_num_seqs < 1:
            raise ValueError(f"native engine: max_num_seqs must be >= 1, got {max_num_seqs}")
        budget = int(kv_cache_tokens) if kv_cache_tokens else max_num_seqs * self.max_model_len
        if budget < self.max_model_len:
            raise ValueError(
                f"native engine: kv_cache_tokens={budget} cannot hold one sequence of max_model_len="
                f"{self.max_model_len} tokens; raise kv_cache_tokens or lower max_model_len"
            )
        num_slots = min(int(max_num_seqs), budget // self.max_model_len)
        if cuda_graphs is None:
            cuda_graphs = self._spec.kind == "cuda"
        self._runner = ModelRunner(
            model,
            device=self._spec,
            num_slots=num_slots,
            slot_len=self.max_model_len,
            cuda_graphs=cuda_graphs,
            kv_len_bucket=kv_len_bucket,
            compile_decode=compile_decode,
            fast_decode=fast_decode,
            true_on_policy_span=attention_span(self.max_model_len) if true_on_policy else None,
        )
        self._true_on_policy = bool(true_on_policy)
        self.vocab_size = self._runner.vocab_size
        self.eos_token_ids = frozenset(self._eos_ids(model) if eos_token_ids is None else eos_token_ids)
        self._sched = Scheduler(num_slots=num_slots, max_num_batched_tokens=max_num_batched_tokens)
        self._loader = WeightLoader(model, check_finite=check_finite_weights)
        self._generator = torch.Generator(device=self._spec.torch_device).manual_seed(int(seed))
        self._version = int(version)
        self._paused = False
        self._stopped = False
        # counters (written by the worker only)
        self._generated = 0
        self._kv_used = 0
        self._rate_events: collections.deque[tuple[float, int]] = collections.deque()
        self._rate_sum = 0  # tokens in _rate_events
        self._rate = 0.0
        self._max_cache_len = 0  # largest cache length (next decode position) among the running
        self._decode_plan: Optional[SamplingPlan] = None  # sampling settings of the running batch
        self._profile = collections.Counter()
        # worker
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._post_lock = threading.Lock()  # no command can slip in after the worker's last drain
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="native-engine", daemon=True)
        self._thread.start()
        # start-up (utils/startup.py): the weights onto the device, then the KV cache and the model runner
        self.startup_phases = [("model_load", loading, loaded), ("engine_build", loaded, time.time())]

    # ------------------------------------------------------------------ construction helpers
    def _load(self, path, dtype, trust_remote_code, override_config, attn_implementation):
        from verl_async.models.loading import load_causal_lm

        return load_causal_lm(
            path,
            dtype=dtype or device_lib.default_dtype(self._spec.kind),
            trust_remote_code=trust_remote_code,
            override_config=override_config,
            attn_implementation=attn_implementation,
            device=self._spec.torch_device,
        )

    @staticmethod
    def _eos_ids(model) -> list[int]:
        ids: list[int] = []
        for source in (model.config, getattr(model, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if eos is None:
                continue
            ids.extend([eos] if isinstance(eos, int) else list(eos))
        return ids

    def _auto_max_num_seqs(self, model: torch.nn.Module, kv_cache_tokens: Optional[int],
                           gpu_memory_utilization: float) -> int:
        """max_num_seqs=null: kv_cache_tokens' slots when given; on CUDA the slots free memory holds; else 64."""
        if kv_cache_tokens:
            return max(1, int(kv_cache_tokens) // self.max_model_len)
        if self._spec.kind != "cuda":
            return DEFAULT_MAX_NUM_SEQS
        geo = model_geometry(model.config)
        dtype_bytes = next(model.parameters()).element_size()
        weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        free, total = torch.cuda.mem_get_info(self._spec.torch_device)
        slots, why = auto_slots(free_bytes=free, total_bytes=total, weight_bytes=weights,
                                gpu_memory_utilization=float(gpu_memory_utilization),
                                bytes_per_token=kv_bytes_per_token(geo["num_layers"], geo["num_kv_heads"],
                                                                   geo["head_dim"], dtype_bytes),
                                max_model_len=self.max_model_len)
        logger.warning("native engine: max_num_seqs=null: %s (set actor_rollout_ref.rollout.max_num_seqs to fix it)",
                       why)
        return slots

    @classmethod
    def from_config(
        cls,
        rollout_cfg: Mapping[str, Any],
        *,
        model_path: Optional[str] = None,
        model: Optional[torch.nn.Module] = None,
        device: str = "cpu",
        trust_remote_code: bool = False,
        override_config: Optional[Mapping[str, Any]] = None,
        **overrides: Any,
    ) -> "NativeEngine":
        """Build from `actor_rollout_ref.rollout` (verl keys) plus `engine_kwargs.native` (e.g. fast_decode).

        max_model_len defaults to prompt_length + response_length; `enforce_eager: true`
        turns CUDA graphs off (vLLM's meaning of the key), null leaves them on for CUDA; dtype applies on accelerators only
        (CPU runs float32 so that log-probs match the trainer exactly).
        """
        get = rollout_cfg.get
        max_model_len = rollout_max_model_len(rollout_cfg)
        kwargs: dict[str, Any] = {
            "max_num_seqs": None if get("max_num_seqs") is None else int(get("max_num_seqs")),
            "gpu_memory_utilization": float(get("gpu_memory_utilization", 0.5) or 0.5),
            "max_model_len": max_model_len,
            "kv_cache_tokens": get("kv_cache_tokens"),
            "max_num_batched_tokens": int(get("max_num_batched_tokens", 8192)),
            "seed": int(get("seed", 0) or 0),
            "dtype": None if device == "cpu" else get("dtype"),
            "cuda_graphs": None if get("enforce_eager") is None else not bool(get("enforce_eager")),
            "true_on_policy": bool(get("true_on_policy", False)),
        }
        native = (get("engine_kwargs") or {}).get("native") or {}
        kwargs.update(dict(native))
        kwargs.update(overrides)
        return cls(
            model_path,
            model=model,
            device=device,
            trust_remote_code=trust_remote_code,
            override_config=override_config,
            **kwargs,
        )

    # ------------------------------------------------------------------ public API (event-loop side)
    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def num_slots(self) -> int:
        return self._sched.num_slots

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        problem = request_problem(request, self.vocab_size, self.max_model_len)
        if problem is not None:
            return rejected(request, problem)
        seq = self._make_sequence(request, None)
        already = seq.check_finished() if request.prefix_token_ids else None
        if already is not None:  # the prefix already ended (stop token or budget): nothing to generate
            seq.finish_reason = already
            return seq.result()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        seq.deliver = functools.partial(_deliver, loop, fut)
        try:
            self._post(self._add, seq)
        except RuntimeError as exc:
            return rejected(request, str(exc))
        try:
            return await fut
        except asyncio.CancelledError:
            try:
                self._post(self._abort_now, [request.request_id])
            except RuntimeError:  # shut down meanwhile: nothing left to abort
                pass
            raise

    async def abort(self, request_ids: Optional[Seq[str]] = None) -> None:
        await self._call(self._abort_now, None if request_ids is None else list(request_ids))

    async def pause(self) -> None:
        """Stop scheduling steps; returns once no step is in progress (in-flight requests wait)."""
        await self._call(self._set_paused, True)

    async def resume(self) -> None:
        await self._call(self._set_paused, False)

    async def update_weights(self, named_tensors: Iterable[Any], version: int) -> None:
        """Load HF-named tensors (pairs or buckets) in place between two steps; then new tokens carry `version`.

        The stream is consumed in the engine's worker thread, so a producer that blocks
        (ray.get of the next bucket) does not block the event loop. A bad item raises
        WeightUpdateError (naming the tensor) here; the version is then not bumped.
        """
        await self._call(self._load_weights, named_tensors, int(version))

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._sched.running),
            waiting=len(self._sched.waiting),
            tokens_per_s=self._rate,
            kv_used_tokens=self._kv_used,
            kv_budget_tokens=self._sched.num_slots * self.max_model_len,
            generated_tokens=self._generated,
            version=self._version,
            paused=self._paused,
        )

    def unwritten_parameters(self, version: int) -> list[str]:
        """Parameters no load under `version` wrote (weight sync checks that a full sync wrote them all)."""
        return self._loader.unwritten(version)

    def progress(self, request_id: str) -> int:
        """Response tokens (prefix included) a request in flight holds now; -1 if unknown."""
        seq = self._sched.by_id.get(request_id)
        return len(seq.token_ids) if seq is not None else -1

    def profile(self) -> dict[str, float]:
        """Cumulative step counters (benchmarks): decode steps, rows, KV tokens read, seconds."""
        out = dict(self._profile)
        out["weight_bytes"] = self._runner.weight_bytes
        out["kv_bytes_per_token"] = self._runner.cache.bytes_per_token
        out["peak_running"] = self._sched.peak_running
        out["graphs"] = self._runner.graphs_captured  # CUDA decode graphs captured so far, and the seconds it took
        out["graph_capture_s"] = self._runner.graph_capture_s
        return out

    async def warmup(self, max_batch: Optional[int] = None, max_kv_len: Optional[int] = None) -> int:
        """Capture the CUDA decode graphs now (while idle) instead of lazily mid-run; returns how many."""
        return await self._call(self._runner.warmup, max_batch, max_kv_len)

    async def shutdown(self) -> None:
        if self._thread.is_alive():
            try:
                await self._call(self._stop)
            except RuntimeError:
                pass
            await asyncio.to_thread(self._thread.join, 60)

    def close(self) -> None:
        """Synchronous shutdown (outside an event loop)."""
        if self._thread.is_alive():
            try:
                self._post(self._stop).result(timeout=60)
            except RuntimeError:
                pass
            self._thread.join(60)

    def _make_sequence(self, request: GenerateRequest, deliver: Optional[Callable]) -> Sequence:
        sp = request.sampling
        stop = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop |= self.eos_token_ids
        generator = None
        if sp.seed is not None and sp.temperature > 0:
            generator = torch.Generator(device=self._spec.torch_device).manual_seed(int(sp.seed))
        return Sequence(
            request=request,
            deliver=deliver or (lambda result: None),
            stop_ids=frozenset(stop),
            max_total_len=self.max_model_len,
            generator=generator,
        )

    # ------------------------------------------------------------------ command plumbing
    def _post(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._post_lock:
            if self._stopped or not self._thread.is_alive():
                raise RuntimeError("native engine is shut down")
            self._commands.put((fn, args, fut))
        self._wake.set()
        return fut

    async def _call(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.wrap_future(self._post(fn, *args))

    def _drain(self) -> None:
        if self._commands.empty():  # the usual case between two steps
            return
        while True:
            try:
                fn, args, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    # ------------------------------------------------------------------ worker thread
    def _loop(self) -> None:
        if self._spec.kind != "cpu":
            self._spec.set_current()
        with torch.inference_mode():
            while not self._stopped:
                self._drain()
                if self._stopped:
                    break
                if self._paused or not self._sched.has_work():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                try:
                    self._step()
                except Exception as exc:  # noqa: BLE001 - a bug in a step must not kill the engine
                    logger.exception("native engine: step failed")
                    self._fail(self._sched.running, exc)
                    self._retire()
            self._fail(list(self._sched.running) + list(self._sched.waiting), RuntimeError("engine shut down"))
            self._retire()  # no command can be queued any more: _stop closed _post under its lock

    def _step(self) -> None:
        sched, runner = self._sched, self._runner
        admitted = sched.admit() if sched.waiting else []
        if admitted:
            t0 = time.perf_counter()
            contexts = [s.context for s in admitted]
            slots = [s.slot for s in admitted]
            try:
                logits = runner.prefill(contexts, slots)
                for seq, ctx in zip(admitted, contexts):
                    seq.cache_len = len(ctx)
                tokens, log_probs = sample_with_plan(logits, self._plan_for(admitted, logits), self._generator,
                                                     true_on_policy=self._true_on_policy)
                runner.set_rows(slots, tokens, [len(ctx) for ctx in contexts])
                self._record(admitted, *runner.to_host(tokens, log_probs), decoded=False)
            except Exception as exc:  # noqa: BLE001 - fail this prefill's requests, keep serving
                logger.exception("native engine: prefill of %d request(s) failed", len(admitted))
                self._fail(admitted, exc)
            self._count("prefill", len(admitted), sum(map(len, contexts)), t0)
            self._retire()
        running = sched.running
        if running:
            t0 = time.perf_counter()
            rows = len(running)
            kv_tokens = self._kv_used + rows  # keys read: every cached token plus the new one, per row
            try:
                logits = runner.decode(rows, self._max_cache_len)
                plan = self._decode_plan
                if plan is None:  # the batch changed since the last step
                    plan = self._decode_plan = self._plan_for(running, logits)
                tokens, log_probs = sample_with_plan(logits, plan, self._generator, true_on_policy=self._true_on_policy)
                runner.advance(rows, tokens)
                done = self._record(running, *runner.to_host(tokens, log_probs), decoded=True)
            except Exception as exc:  # noqa: BLE001
                logger.exception("native engine: decode step of %d sequence(s) failed", rows)
                self._fail(running, exc)
                done = True
            self._count("decode", rows, kv_tokens, t0)
            if done:
                self._retire()
            else:  # every row is one token longer, nothing else changed
                self._kv_used += rows
                self._max_cache_len += 1

    def _plan_for(self, seqs: list[Sequence], logits: torch.Tensor) -> SamplingPlan:
        sps = [s.request.sampling for s in seqs]
        return SamplingPlan(
            [sp.temperature for sp in sps],
            [sp.top_k for sp in sps],
            [sp.top_p for sp in sps],
            [s.generator for s in seqs],
            vocab=logits.size(-1),
            device=logits.device,
        )

    def _record(self, seqs: list[Sequence], tokens: list[int], log_probs: list[float], *, decoded: bool) -> bool:
        """Append each row's sampled token; True if any sequence finished (stop, length or bad logits)."""
        version = self._version
        isfinite = math.isfinite
        done = False
        for seq, token, log_prob in zip(seqs, tokens, log_probs):
            if decoded:
                seq.cache_len += 1
            if not isfinite(log_prob):
                seq.error = f"request {seq.request_id!r}: the model produced NaN/Inf logits"
                seq.finish_reason = "abort"
                done = True
            elif seq.append(token, log_prob, version):
                done = True
        self._note_tokens(len(seqs))
        return done

    def _note_tokens(self, n: int) -> None:
        now = time.monotonic()
        self._generated += n
        events = self._rate_events
        events.append((now, n))
        self._rate_sum += n
        while events and events[0][0] < now - _RATE_WINDOW_S:
            self._rate_sum -= events.popleft()[1]
        span = max(now - events[0][0], 1e-3) if len(events) > 1 else _RATE_WINDOW_S
        self._rate = self._rate_sum / span

    def _count(self, kind: str, rows: int, kv_tokens: int, t0: float) -> None:
        # no device sync needed for honest timings: to_host waited for this step's sampled tokens
        p = self._profile
        p[f"{kind}_steps"] += 1
        p[f"{kind}_rows"] += rows
        p[f"{kind}_kv_tokens"] += kv_tokens
        p[f"{kind}_s"] += time.perf_counter() - t0

    def _fail(self, seqs: Iterable[Sequence], exc: BaseException) -> None:
        for seq in seqs:
            if not seq.done:
                seq.error = f"request {seq.request_id!r}: {type(exc).__name__}: {exc}"
                seq.finish_reason = "abort"

    def _retire(self) -> None:
        """Drop finished sequences, compact the slots, deliver the results; run whenever the batch may have changed."""
        finished, src, dst = self._sched.finish()
        running = self._sched.running
        length = 0
        if src:
            targets = set(dst)
            length = max(s.cache_len for s in running if s.slot in targets)
        self._runner.move_rows(src, dst, length, len(running))
        self._kv_used = sum(s.cache_len for s in running)
        self._max_cache_len = max((s.cache_len for s in running), default=0)
        self._decode_plan = None  # rows may have moved, joined or left
        for seq in finished:
            seq.deliver(seq.result())

    # ------------------------------------------------------------------ commands (run in the worker)
    def _add(self, seq: Sequence) -> None:
        if seq.request_id in self._sched.by_id:
            seq.error = f"request {seq.request_id!r}: a request with this id is already in flight"
            seq.deliver(seq.result())
            return
        self._sched.add(seq)

    def _abort_now(self, request_ids: Optional[list[str]]) -> None:
        targets = list(self._sched.by_id.values()) if request_ids is None else [
            self._sched.by_id[r] for r in request_ids if r in self._sched.by_id
        ]
        for seq in targets:
            if not seq.done:
                seq.finish_reason = "abort"
        self._retire()

    def _set_paused(self, paused: bool) -> None:
        self._paused = paused

    def _load_weights(self, stream: Iterable[Any], version: int) -> None:
        t0 = time.perf_counter()
        n = self._loader.load(stream, version)
        self._version = version
        logger.info("native engine: loaded %d tensors in %.2fs, now version %d", n, time.perf_counter() - t0, version)

    def _stop(self) -> None:
        with self._post_lock:
            self._stopped = True
