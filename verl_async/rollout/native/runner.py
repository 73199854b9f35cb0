"""Model forward passes for the native engine: padded prefill and slot-batched decode.

The runner owns the HF model and the SlotKVCache and turns token lists into next-token
logits (float32). It knows nothing about requests. On CUDA the decode step is captured
as CUDA graphs, one per (batch bucket, KV-length bucket), lazily or all at once in
`warmup()`: decode of a small model is launch-bound (hundreds of tiny kernels per step),
and a graph replays them without Python/launch overhead. Weights are updated in place
(same storage), so captured graphs stay valid across refits. Prefill stays eager (it is
compute-bound and its shapes vary). `compile_decode` additionally runs the decode step
through torch.compile (inside the graphs on CUDA). NPU runs eager (torch_npu graph mode is
not wired; NPU is untested here). `fast_decode` (default on) runs the decode step of
llama/mistral/qwen2/qwen3 models through fast_decode.FastDecoder (same numbers from the same
weights, ~14 instead of ~43 kernels per layer expected on CUDA, q/k/v and gate/up as one GEMM each); other
models decode through the HF forward.

`true_on_policy_span` (true on-policy mode, verl_async.invariant): the model is patched with the
batch-invariant kernels the trainer uses; prefill runs the HF forward, decode (with `fast_decode`)
invariant_decode.InvariantDecoder: the same kernels on the same values in fewer launches, no masks
(no torch.compile, no FastDecoder fusions: they change the arithmetic). Cache slots hold `span`
positions; on CUDA every decode step has that one KV length (one graph per batch bucket; the
attention kernel reads each row's position from the device and stops at its last key), on CPU a
step reads only the keys in use (exact sums). CUDA graphs replay those same kernels.
"""

from __future__ import annotations

import bisect
import inspect
import logging
import time
from typing import Callable, Optional

import torch

from verl_async.invariant import make_invariant
from verl_async.invariant.attention import ATTENTION_NAME
from verl_async.rollout.native.fast_decode import FAST_DECODE_ATTENTION, FastDecoder, fast_decode_problem
from verl_async.rollout.native.invariant_decode import InvariantDecoder
from verl_async.rollout.native.kv_cache import SlotKVCache, decode_masks, prefill_masks
from verl_async.utils.device import DeviceSpec

logger = logging.getLogger(__name__)

SUPPORTED_ATTENTION = ("sdpa", "eager")
# CausalLM families whose logits are exactly lm_head(last hidden state) (no softcap, no scale)
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def batch_buckets(max_batch: int) -> list[int]:
    """Decode batch sizes graphs are captured for: 1, 2, 4, 8, then ~1.5x steps, and max_batch."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b = b * 2 if b < 16 else (b + b // 2 + 7) // 8 * 8
    sizes.append(max_batch)
    return sizes


def cache_keyword(module: torch.nn.Module) -> str:
    """The keyword an HF forward takes its KV cache by, read from its signature: `cache` where transformers has
    renamed it (5.24 warns on every call with `past_key_values`, removed in 5.40), `past_key_values` on older
    releases (the floor, 4.56.2, would drop an unknown `cache` into **kwargs silently)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def model_geometry(config) -> dict:
    """Layer count, KV heads, head dim, layer types and sliding window of an HF decoder config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = text.num_hidden_layers
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if not layer_types:
        # no per-layer list: Mistral-style configs slide on every layer when a window is set
        layer_types = ["sliding_attention" if window else "full_attention"] * num_layers
    layer_types = list(layer_types)
    return {
        "num_layers": num_layers,
        "num_kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "layer_types": layer_types,
        "sliding_window": window,
    }


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: DeviceSpec,
        num_slots: int,
        slot_len: int,
        cuda_graphs: bool = False,
        kv_len_bucket: int = 256,
        compile_decode: bool = False,
        fast_decode: bool = True,
        true_on_policy_span: Optional[int] = None,
    ) -> None:
        self.invariant = true_on_policy_span is not None
        if self.invariant:
            if compile_decode:
                raise ValueError("native engine: compile_decode cannot run in true on-policy mode (fusions change the "
                                 "arithmetic); drop engine_kwargs.native.compile_decode")
            make_invariant(model, true_on_policy_span, keep_weight_grids=True)
            slot_len = int(true_on_policy_span)
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in SUPPORTED_ATTENTION and not self.invariant:
            raise ValueError(
                f"native engine: model attention implementation {impl!r} is not supported; load the model "
                f"with attn_implementation in {SUPPORTED_ATTENTION}"
            )
        self.model, self.device, self.attn_impl = model, device, impl
        self.dtype = next(model.parameters()).dtype
        geo = model_geometry(model.config)
        self.layer_types, self.sliding_window = geo["layer_types"], geo["sliding_window"]
        self.cache = SlotKVCache(
            num_layers=geo["num_layers"],
            num_slots=num_slots,
            slot_len=slot_len,
            num_kv_heads=geo["num_kv_heads"],
            head_dim=geo["head_dim"],
            dtype=self.dtype,
            device=device.torch_device,
        )
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        # Prefill needs one row of logits per sequence (at its own last position). How HF reads a
        # tensor `logits_to_keep` changed between releases (5.17 broadcasts a [n, 1] index over the
        # batch), so for families whose head is a plain projection the runner applies the head
        # itself to the gathered hidden states; other models compute all logits and gather.
        plain = getattr(model.config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES
        self._decoder = model.get_decoder() if plain else None
        self._head = model.get_output_embeddings() if plain else None
        self._model_cache_kw = cache_keyword(model)
        self._decoder_cache_kw = cache_keyword(self._decoder) if self._decoder is not None else self._model_cache_kw
        # The decode step: FastDecoder (few kernels, same numbers) when the model is one it knows, else HF's forward.
        self._fast: Optional[FastDecoder] = None
        if fast_decode:
            problem = fast_decode_problem(model, (ATTENTION_NAME,) if self.invariant else FAST_DECODE_ATTENTION)
            if problem is None and self.invariant:
                self._fast = InvariantDecoder(model, self.cache, self.layer_types, slot_len, self.sliding_window)
            elif problem is None:
                self._fast = FastDecoder(model, self.cache, self.layer_types)
            else:
                logger.info("native engine: fast decode off, decoding through the HF forward: %s", problem)
        self.kv_len_bucket = max(1, int(kv_len_bucket))
        self._batch_buckets = batch_buckets(num_slots)
        # torch.compile fuses the many small elementwise kernels of a decode step (norms, rotary,
        # SiLU); opt-in because compiling takes minutes on first use. Traced with fullgraph=True
        # on CPU (no graph breaks); whether it pays on GPU is for the benchmark to say.
        self._compiled = torch.compile(self._forward_decode, dynamic=True) if compile_decode else None
        self._graphs: dict[tuple[int, int], Callable[[], None]] = {}
        self.graph_capture_s = 0.0  # host seconds spent capturing decode graphs (lazily, in the first decode steps)
        self._pool = None
        # Decode inputs live on the device, one entry per slot, and are updated in place by
        # `set_rows` (after a prefill), `advance` (after a decode step: the sampled tokens are
        # the next inputs, positions + 1) and `move_rows` (compaction), so a decode step builds
        # nothing from Python lists and copies nothing host->device. Row r holds the last sampled
        # token of the sequence in slot r and the position it goes to (its cache length); rows
        # of free slots hold position 0 (see move_rows), so a padded graph row writes only
        # position 0 of a free slot. These are the CUDA graphs' static inputs: never rebound.
        dev, slots = device.torch_device, self.cache.num_slots
        self._ids = torch.zeros(slots, dtype=torch.long, device=dev)
        self._pos = torch.zeros(slots, dtype=torch.long, device=dev)
        # one device->host copy per step on CUDA: sampled ids and log-probs, asynchronously into
        # pinned buffers, then one wait (elsewhere: .tolist(), which copies and waits itself)
        self._pinned = device.kind == "cuda"
        if self._pinned:
            self._host_ids = torch.zeros(slots, dtype=torch.long, pin_memory=True)
            self._host_lps = torch.zeros(slots, dtype=torch.float32, pin_memory=True)
            self._copied = torch.cuda.Event()
        # Static decode: fixed output buffer and (batch, KV length) buckets, so that each bucket's
        # step can be replayed as a CUDA graph. Off means exact shapes, eager.
        self.static_decode = False
        if cuda_graphs and device.kind == "cuda":
            self._enable_static_decode()

    def _enable_static_decode(self) -> None:
        dev, slots = self.device.torch_device, self.cache.num_slots
        self._logits = torch.zeros(slots, self.vocab_size, dtype=torch.float32, device=dev)
        self.static_decode = True

    # ------------------------------------------------------------------ decode inputs (device-resident)
    def set_rows(self, slots: list[int], tokens: torch.Tensor, positions: list[int]) -> None:
        """After a prefill: slots[i]'s next decode input is tokens[i] at position positions[i]."""
        dev = self.device.torch_device
        index = torch.tensor(slots, dtype=torch.long, device=dev)
        self._ids.index_copy_(0, index, tokens.to(torch.long))
        self._pos.index_copy_(0, index, torch.tensor(positions, dtype=torch.long, device=dev))

    def advance(self, rows: int, tokens: torch.Tensor) -> None:
        """After a decode step of rows 0..rows-1: their sampled tokens are the next inputs, one position on."""
        self._ids[:rows].copy_(tokens)
        self._pos[:rows].add_(1)

    def move_rows(self, src: list[int], dst: list[int], length: int, live: int) -> None:
        """Compaction: slots `src` move to `dst` (KV up to `length` and decode inputs); rows >= `live` are freed."""
        if src:
            self.cache.move(src, dst, length)
            dev = self.device.torch_device
            src_t = torch.tensor(src, dtype=torch.long, device=dev)
            dst_t = torch.tensor(dst, dtype=torch.long, device=dev)
            self._ids.index_copy_(0, dst_t, self._ids.index_select(0, src_t))
            self._pos.index_copy_(0, dst_t, self._pos.index_select(0, src_t))
        # a free row keeps position 0: a padded graph row then writes inside its (free) slot;
        # a finished row's position can be slot_len after its last step
        self._pos[live:].zero_()

    def to_host(self, tokens: torch.Tensor, log_probs: torch.Tensor) -> tuple[list[int], list[float]]:
        """Sampled ids and float32 log-probs as Python lists: one device->host transfer and one wait."""
        if self.device.kind == "cpu":
            return tokens.tolist(), log_probs.tolist()
        n = tokens.numel()
        if not self._pinned:  # NPU: one synchronous copy of both
            host = torch.stack([tokens.double(), log_probs.double()]).cpu()
            return [int(t) for t in host[0].tolist()], host[1].tolist()
        ids, lps = self._host_ids[:n], self._host_lps[:n]
        ids.copy_(tokens, non_blocking=True)
        lps.copy_(log_probs, non_blocking=True)
        self._copied.record()
        self._copied.synchronize()  # the pinned buffers hold this step's values (and the step is done)
        return ids.tolist(), lps.tolist()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (tied ones once): what one decode step must read."""
        seen, total = set(), 0
        for p in self.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total

    # ------------------------------------------------------------------ prefill
    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Run new sequences (right-padded) from position 0 into `slots`; return [n, V] last-token logits."""
        dev = self.device.torch_device
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(dev)
        positions = torch.arange(width, device=dev)[None, :].expand(len(prompts), width)
        last = torch.tensor([len(p) - 1 for p in prompts], device=dev)
        masks = prefill_masks(
            width,
            layer_types=self.layer_types,
            sliding_window=self.sliding_window,
            attn_implementation=self.attn_impl,
            dtype=self.dtype,
            device=dev,
        )
        self.cache.set_prefill(torch.tensor(slots, device=dev), width)
        inputs = dict(input_ids=ids, position_ids=positions, attention_mask=masks, use_cache=True)
        rows = torch.arange(len(prompts), device=dev)
        if self._head is None:
            return self.model(**inputs, **{self._model_cache_kw: self.cache}).logits[rows, last].float()
        hidden = self._decoder(**inputs, **{self._decoder_cache_kw: self.cache}).last_hidden_state
        return self._head(hidden[rows, last]).float()

    # ------------------------------------------------------------------ decode
    def _forward_decode(self, ids: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        if isinstance(self._fast, InvariantDecoder):  # masks itself from the positions
            return self._fast(ids, positions, None, kv_len)
        masks = decode_masks(
            positions,
            kv_len,
            layer_types=self.layer_types,
            sliding_window=self.sliding_window,
            attn_implementation=self.attn_impl,
            dtype=self.dtype,
        )
        if self._fast is not None:
            return self._fast(ids, positions, masks, kv_len)
        self.cache.set_decode(positions, kv_len)
        out = self.model(
            input_ids=ids[:, None],
            position_ids=positions[:, None],
            attention_mask=masks,
            use_cache=True,
            **{self._model_cache_kw: self.cache},
        )
        return out.logits[:, -1].float()

    def _decode_fn(self, ids: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        if self._compiled is not None:
            try:
                return self._compiled(ids, positions, kv_len)
            except Exception:  # noqa: BLE001 - e.g. no working compiler toolchain: stay correct, run eager
                logger.exception("native engine: torch.compile of the decode step failed; decoding eagerly")
                self._compiled = None
        return self._forward_decode(ids, positions, kv_len)

    def kv_len_for(self, max_position: int) -> int:
        """Keys a decode step reads per row: exact in eager mode, bucketed when replaying graphs."""
        need = max_position + 1
        if self.invariant and self.device.kind != "cpu":  # CUDA's fixed shapes; CPU's exact sums read what is used
            return self.cache.slot_len
        if not self.static_decode:
            return need
        return min(self.cache.slot_len, -(-need // self.kv_len_bucket) * self.kv_len_bucket)

    def decode(self, rows: int, max_position: int) -> torch.Tensor:
        """One token for each of the rows 0..rows-1 (slot b = row b) from the device-resident inputs
        (see set_rows / advance); `max_position` is the largest of their positions. Return [rows, V] logits."""
        kv_len = self.kv_len_for(max_position)
        if not self.static_decode:
            return self._decode_fn(self._ids[:rows], self._pos[:rows], kv_len)
        padded = self._batch_buckets[bisect.bisect_left(self._batch_buckets, rows)]
        # padding rows (free slots, position 0) write position 0 of their free slot: harmless
        replay = self._graphs.get((padded, kv_len)) or self._capture(padded, kv_len)
        if replay is None:  # capture failed: the runner fell back to eager
            return self.decode(rows, max_position)
        replay()
        return self._logits[:rows]

    def _graph_body(self, batch: int, kv_len: int) -> None:
        self._logits[:batch].copy_(self._decode_fn(self._ids[:batch], self._pos[:batch], kv_len))

    def _capture(self, batch: int, kv_len: int) -> Optional[Callable[[], None]]:
        """Make the replayable step of one bucket; on failure log and switch to eager for good."""
        t0 = time.perf_counter()
        try:
            replay = self._new_graph(batch, kv_len)
            self.graph_capture_s += time.perf_counter() - t0
        except Exception:  # noqa: BLE001 - any capture problem means: run eager
            logger.exception("native engine: CUDA graph capture failed (batch %d, kv %d); decoding eagerly", batch, kv_len)
            self.static_decode = False
            self._graphs.clear()
            return None
        self._graphs[(batch, kv_len)] = replay
        return replay

    def _new_graph(self, batch: int, kv_len: int) -> Callable[[], None]:
        """Capture the decode step of one bucket as a CUDA graph; the inputs hold this step's values.

        The warm-up runs repeat the real step (same inputs, same K/V written), so capturing in
        the middle of a run changes nothing. All graphs share one memory pool (they never run
        concurrently and keep no live outputs: logits are copied into a static buffer).
        """
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._graph_body(batch, kv_len)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._graph_body(batch, kv_len)
        return graph.replay

    @property
    def graphs_captured(self) -> int:
        return len(self._graphs)

    def warmup(self, max_batch: Optional[int] = None, max_kv_len: Optional[int] = None) -> int:
        """Capture every decode graph up to (max_batch, max_kv_len) now (best while no sequence runs).

        Returns the number of graphs captured. Without graphs but with `compile_decode`, runs
        the decode step at a few shapes so that compilation (batch 1 is specialised, then the
        shapes turn dynamic) happens here rather than in the first requests.
        """
        max_batch = min(max_batch or self.cache.num_slots, self.cache.num_slots)
        max_kv_len = min(max_kv_len or self.cache.slot_len, self.cache.slot_len)
        if not self.static_decode:
            if self._compiled is not None:
                dev = self.device.torch_device
                for batch, kv_len in ((1, 1), (1, 2), (min(2, max_batch), 3), (min(3, max_batch), 4)):
                    ids = torch.zeros(batch, dtype=torch.long, device=dev)
                    self._decode_fn(ids, torch.zeros_like(ids), kv_len)
            return 0
        batches = [b for b in self._batch_buckets if b < max_batch]
        batches.append(self._batch_buckets[bisect.bisect_left(self._batch_buckets, max_batch)])
        lens = [self.cache.slot_len] if self.invariant else (
            list(range(self.kv_len_bucket, max_kv_len, self.kv_len_bucket)) + [self.kv_len_for(max_kv_len - 1)])
        for batch in batches:
            # the inputs stay as they are: live rows repeat their real next step (same K/V written),
            # free rows sit at position 0 of their free slot
            for kv_len in lens:
                if (batch, kv_len) not in self._graphs and self._capture(batch, kv_len) is None:
                    return len(self._graphs)
        self.device.synchronize()
        return len(self._graphs)
