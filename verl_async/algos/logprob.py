"""Log-prob of chosen tokens and entropy from logits, chunked over tokens.

Convention shared with the rollout engines (verl_async/rollout/engine.py):

    logp[i] = log_softmax(logits[i].float() / temperature)[labels[i]]

computed in float32 (float64 stays float64), top-k/top-p NOT renormalised;
temperature 0 or None means 1 (greedy sampling reports T=1 log-probs). Entropy is
that of the same temperature-scaled distribution, `H = -sum p log p`.

Memory. A naive `log_softmax(logits.float())` holds `N x V` float32 (32k tokens x
152k vocab = 19.9 GB), and autograd keeps it for backward. Here a custom autograd
function works on `chunk_size` rows at a time in forward AND backward (it recomputes
the softmax of a chunk from the saved logits and log-sum-exp), so the extra memory
is two float32 chunk buffers in forward (three in backward), allocated once and
reused; backward writes the logits' gradient (same dtype as the
logits, unavoidable) chunk by chunk. Inputs with a non-contiguous layout are copied
once (in their own dtype) by the flattening reshape.

`use_torch_compile=True` (the trainer's `actor_rollout_ref.{actor,ref}.use_torch_compile`)
keeps the chunk loop and the custom autograd function but runs the per-chunk math (the
pure functions `_fwd_*` / `_bwd_*` below) through `torch.compile` (fullgraph, the chunk's
row dimension dynamic, compiled lazily once per process), so inductor fuses cast, max,
exp, sum and gather into a few kernels; the compiled forward returns only per-row
vectors and the backward writes the logits' gradient chunk in place (what inductor
keeps in between is its choice: at most the eager path's float32 chunk). Same
fp32 math, not bit-identical to the eager path (reduction order differs). With False
(the default) the eager code below runs unchanged.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, NamedTuple

import torch

from ._checks import check_tensor

# Working-buffer budget per chunk when chunk_size is None: 256 MiB of float32.
DEFAULT_CHUNK_BYTES = 1 << 28


def normalize_temperature(temperature: float | None) -> float:
    """0 or None -> 1.0 (greedy reports T=1 log-probs); refuses negative / non-finite."""
    if temperature is None:
        return 1.0
    t = float(temperature)
    if not (t == t and abs(t) != float("inf")) or t < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    return 1.0 if t == 0 else t


def logprob_temperature(temperature: float | None, do_sample: bool = True) -> float:
    """The temperature of a rollout's log-probs, the same for the engine and the trainer.

    Greedy decoding (`do_sample=False`, or temperature 0) picks the argmax, which no
    temperature changes, and engines report the model's own distribution (T=1: vLLM has
    no other for a temperature-0 request). So greedy samples are recomputed at 1, not at
    `rollout.temperature`, which then only applies when sampling.
    """
    return normalize_temperature(temperature) if do_sample else 1.0


def _chunk_rows(chunk_size: int | None, vocab: int) -> int:
    if chunk_size is None:
        return max(1, DEFAULT_CHUNK_BYTES // (4 * max(vocab, 1)))
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size!r}")
    return int(chunk_size)


class _Buffers:
    """Chunk work buffers allocated once and reused: on CPU a fresh 256 MiB tensor per
    chunk is a fresh mmap, and page-faulting it in again every chunk costs more system
    time than the math (GPU caching allocators hide this; reuse is right for both)."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = (rows, vocab), dtype, device
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int) -> torch.Tensor:
        if name not in self._bufs:
            self._bufs[name] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._bufs[name][:rows]

    def padded(self, chunk: torch.Tensor, temperature: float) -> torch.Tensor:
        """`scaled` into the full-size buffer, the rows past `chunk` zero: every call has the same shape
        (`fixed_chunks`), so a row's max, sum and log do not depend on how many rows came with it."""
        x = self.get("x", self.shape[0])
        rows = chunk.shape[0]
        x[:rows].copy_(chunk)
        if rows < self.shape[0]:
            x[rows:].zero_()
        return x.div_(temperature) if temperature != 1.0 else x

    def scaled(self, chunk: torch.Tensor, temperature: float) -> torch.Tensor:
        """`chunk.to(dtype) / temperature`; the chunk itself when that is a no-op (never
        written to)."""
        if chunk.dtype == self.dtype and temperature == 1.0:
            return chunk
        x = self.get("x", chunk.shape[0]).copy_(chunk)
        return x.div_(temperature) if temperature != 1.0 else x


# ---------------------------------------------------------------- compiled path (use_torch_compile=True)
# Pure per-chunk functions: `chunk` is [rows, V] logits in their own dtype, `labels` /
# `lse` / `mean_x` / `g_*` are [rows]; math in promote(dtype, float32) as in the eager path.


def _scaled_x(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    return chunk.to(torch.promote_types(chunk.dtype, torch.float32)) / temperature


def _exp_sum_lse(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all -inf rows stay -inf, not NaN
    e = torch.exp(x - m)
    z = e.sum(-1)
    return e, z, m.squeeze(-1) + z.log()


def _fwd_logp(chunk, labels, temperature):
    x = _scaled_x(chunk, temperature)
    _, _, lse = _exp_sum_lse(x)
    return lse, x.gather(1, labels[:, None]).squeeze(1) - lse


def _fwd_ent(chunk, temperature):
    x = _scaled_x(chunk, temperature)
    e, z, lse = _exp_sum_lse(x)
    return lse, lse - (e * x).nan_to_num(nan=0.0).sum(-1) / z


def _fwd_both(chunk, labels, temperature):
    x = _scaled_x(chunk, temperature)
    e, z, lse = _exp_sum_lse(x)
    return lse, x.gather(1, labels[:, None]).squeeze(1) - lse, lse - (e * x).nan_to_num(nan=0.0).sum(-1) / z


def _onehot_add(gx, labels, g_logp):
    """gx + g_logp at each row's label (the eager path's scatter_add_, as one pointwise op)."""
    hit = torch.arange(gx.shape[1], device=gx.device)[None, :] == labels[:, None]
    return gx + torch.where(hit, g_logp[:, None].to(gx.dtype), torch.zeros_like(gx))


def _bwd_logp(out, chunk, labels, lse, g_logp, temperature):
    x = _scaled_x(chunk, temperature)
    p = torch.exp(x - lse[:, None])
    gx = _onehot_add(p * -g_logp[:, None], labels, g_logp)
    out.copy_(gx / temperature)


def _bwd_ent(out, chunk, lse, mean_x, g_ent, temperature):
    x = _scaled_x(chunk, temperature)
    p = torch.exp(x - lse[:, None])
    gx = ((mean_x[:, None] - x) * p).nan_to_num(nan=0.0) * g_ent[:, None]
    out.copy_(gx / temperature)


def _bwd_both(out, chunk, labels, lse, mean_x, g_logp, g_ent, temperature):
    x = _scaled_x(chunk, temperature)
    p = torch.exp(x - lse[:, None])
    gx = ((mean_x[:, None] - x) * p).nan_to_num(nan=0.0) * g_ent[:, None] - p * g_logp[:, None]
    out.copy_(_onehot_add(gx, labels, g_logp) / temperature)


class _ChunkFns(NamedTuple):
    fwd_logp: Callable
    fwd_ent: Callable
    fwd_both: Callable
    bwd_logp: Callable
    bwd_ent: Callable
    bwd_both: Callable


_EAGER_FNS = _ChunkFns(_fwd_logp, _fwd_ent, _fwd_both, _bwd_logp, _bwd_ent, _bwd_both)


_log = logging.getLogger(__name__)


def _with_eager_fallback(compiled: Callable, eager: Callable) -> Callable:
    """`compiled`, or `eager` (same math, same results up to summation order) for calls that would
    need one compile more than dynamo's `recompile_limit` allows (with fullgraph=True that is a hard
    error, which must not end a training run); warned once per function."""
    limit_hit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None) or getattr(
        torch._dynamo.exc, "RecompileLimitExceeded", RuntimeError)

    def call(*args):
        try:
            return compiled(*args)
        except limit_hit as e:
            if eager.__name__ not in _FALLBACK_WARNED:
                _FALLBACK_WARNED.add(eager.__name__)
                _log.warning("use_torch_compile: %s hit torch._dynamo's recompile_limit (%s); calls that would "
                             "need another compile run eagerly", eager.__name__, e)
            return eager(*args)

    call.__name__ = call.__qualname__ = f"compiled{eager.__name__}"
    call.compiled = compiled  # type: ignore[attr-defined]
    return call


_FALLBACK_WARNED: set[str] = set()


@functools.cache
def compiled_chunk_fns() -> _ChunkFns:
    """The per-chunk functions wrapped in `torch.compile(fullgraph=True)`, built once per process
    (each compiles at its first call). Separate functions per output set keep each one's graphs
    few: one per logits dtype, plus one when the temperature first changes (dynamo then makes it
    symbolic); the row dimension is marked dynamic at every call (`_rows_dynamic`) and 1-row
    chunks are avoided (`_chunk_bounds`), the vocab stays static."""
    return _ChunkFns(*(_with_eager_fallback(torch.compile(f, fullgraph=True), f) for f in _EAGER_FNS))


def _rows_dynamic(*tensors: torch.Tensor) -> None:
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def _chunk_bounds(n: int, chunk: int) -> list[slice]:
    """Slices of at most `chunk` rows covering [0, n), without a 1-row last chunk where that can be
    avoided (dynamo specialises size 1: a separate compile): ..., chunk, 1 becomes ..., chunk - 1, 2."""
    bounds = [*range(0, n, chunk), n]
    if chunk > 2 and len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        bounds[-2] -= 1
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _compiled_forward(fns, logits, labels, temperature, chunk, with_logp, with_entropy):
    n = logits.shape[0]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    lse = torch.empty(n, dtype=dtype, device=logits.device)
    logp = torch.empty(n, dtype=dtype, device=logits.device) if with_logp else None
    ent = torch.empty(n, dtype=dtype, device=logits.device) if with_entropy else None
    logits = logits.detach()  # requires_grad is a guard: one graph for training and no-grad calls
    for sl in _chunk_bounds(n, chunk):
        x, lab = logits[sl], labels[sl]
        _rows_dynamic(x, lab)
        if with_logp and with_entropy:
            lse[sl], logp[sl], ent[sl] = fns.fwd_both(x, lab, temperature)
        elif with_logp:
            lse[sl], logp[sl] = fns.fwd_logp(x, lab, temperature)
        else:
            lse[sl], ent[sl] = fns.fwd_ent(x, temperature)
    return lse, logp, ent


def _compiled_backward(fns, logits, labels, lse, ent, g_logp, g_ent, temperature, chunk):
    n = logits.shape[0]
    grad = torch.empty_like(logits)
    mean_x = (lse - ent) if g_ent is not None else None  # E_p[x] = lse - H
    logits = logits.detach()
    g_logp = g_logp.detach() if g_logp is not None else None
    g_ent = g_ent.detach() if g_ent is not None else None
    for sl in _chunk_bounds(n, chunk):
        out, x = grad[sl], logits[sl]
        if g_ent is not None and g_logp is not None:
            args = (out, x, labels[sl], lse[sl], mean_x[sl], g_logp[sl], g_ent[sl])
            _rows_dynamic(*args)
            fns.bwd_both(*args, temperature)
        elif g_ent is not None:
            args = (out, x, lse[sl], mean_x[sl], g_ent[sl])
            _rows_dynamic(*args)
            fns.bwd_ent(*args, temperature)
        else:
            args = (out, x, labels[sl], lse[sl], g_logp[sl])
            _rows_dynamic(*args)
            fns.bwd_logp(*args, temperature)
    return grad


class _ChunkedLogProbEntropy(torch.autograd.Function):
    """Forward: per chunk, log-sum-exp, chosen-token log-prob and/or entropy.
    Backward: recompute p = exp(x - lse) per chunk;
    d logp/dx = onehot(label) - p,  dH/dx = p * (E_p[x] - x),  then / temperature."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk, with_logp, with_entropy, fns=None,  # type: ignore[override]
                fixed=False, row_sum=None):
        ctx.temperature, ctx.chunk, ctx.fns = temperature, chunk, fns
        ctx.set_materialize_grads(False)
        if fns is not None:  # use_torch_compile
            lse, logp, ent = _compiled_forward(fns, logits, labels, temperature, chunk, with_logp, with_entropy)
            ctx.save_for_backward(logits, labels, lse, ent)
            return logp, ent
        n, vocab = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        bufs = _Buffers(chunk if fixed else min(chunk, n), vocab, dtype, logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        logp = torch.empty(n, dtype=dtype, device=logits.device) if with_logp else None
        ent = torch.empty(n, dtype=dtype, device=logits.device) if with_entropy else None
        for s in range(0, n, chunk):
            rows = min(chunk, n - s)
            x = bufs.padded(logits[s : s + chunk], temperature) if fixed else bufs.scaled(logits[s : s + chunk], temperature)
            m = x.amax(-1, keepdim=True)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all -inf rows stay -inf, not NaN
            e = torch.sub(x, m, out=bufs.get("e", x.shape[0])).exp_()
            z = e.sum(-1) if row_sum is None else row_sum(e)
            lse_c = (m.squeeze(-1) + z.log())[:rows]
            lse[s : s + chunk] = lse_c
            if with_logp:
                logp[s : s + chunk] = x[:rows].gather(1, labels[s : s + chunk, None]).squeeze(1) - lse_c
            if with_entropy:
                # E_p[x] = sum(e * x) / z; 0 * (-inf) for masked vocab entries counts as 0.
                ent[s : s + chunk] = lse_c - (e.mul_(x).nan_to_num_(nan=0.0).sum(-1) / z)[:rows]
        ctx.save_for_backward(logits, labels, lse, ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):  # type: ignore[override]
        logits, labels, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return (None,) * 9
        temperature, chunk = ctx.temperature, ctx.chunk
        if ctx.fns is not None:  # use_torch_compile
            grad = _compiled_backward(ctx.fns, logits, labels, lse, ent, g_logp, g_ent, temperature, chunk)
            return grad, None, None, None, None, None, None, None, None
        grad = eager_backward(logits, labels, lse, ent, g_logp, g_ent, temperature, chunk)
        return grad, None, None, None, None, None, None, None, None


def eager_backward(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
                   g_logp: torch.Tensor | None, g_ent: torch.Tensor | None, temperature: float,
                   chunk: int | None = None) -> torch.Tensor:
    """The logits' gradient [N, V], `chunk` rows at a time (None: the default budget), from the forward's
    log-sum-exp `lse` (and entropy `ent` when `g_ent` is given): the backward of the eager forward here and of
    true on-policy mode's Triton forward (verl_async.invariant.triton_softmax)."""
    chunk = _chunk_rows(chunk, logits.shape[-1])
    n, vocab = logits.shape
    bufs = _Buffers(min(chunk, n), vocab, lse.dtype, logits.device)
    grad = torch.empty_like(logits)
    mean_x = (lse - ent) if g_ent is not None else None  # E_p[x] = lse - H
    for s in range(0, n, chunk):
        x = bufs.scaled(logits[s : s + chunk], temperature)
        rows = x.shape[0]
        p = torch.sub(x, lse[s : s + chunk, None], out=bufs.get("p", rows)).exp_()
        if g_ent is not None:
            gx = torch.sub(mean_x[s : s + chunk, None], x, out=bufs.get("g", rows))
            gx.mul_(p).nan_to_num_(nan=0.0).mul_(g_ent[s : s + chunk, None])
            if g_logp is not None:
                gx.addcmul_(p, g_logp[s : s + chunk, None], value=-1.0)
        else:
            gx = p.mul_(-g_logp[s : s + chunk, None])
        if g_logp is not None:
            gx.scatter_add_(1, labels[s : s + chunk, None], g_logp[s : s + chunk, None].to(gx.dtype))
        if temperature != 1.0:
            gx.div_(temperature)
        grad[s : s + chunk].copy_(gx)
    return grad


def flatten_checked(logits: torch.Tensor, labels: torch.Tensor | None,
                    with_logp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
    """(logits as [N, V], labels as [N] longs on the logits' device (empty without `with_logp`), the leading
    shape), with a clear error for a non-float logits tensor or labels of another shape, dtype or range."""
    check_tensor("logits", logits)
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating tensor [..., V], got {logits.dtype} {tuple(logits.shape)}")
    vocab = logits.shape[-1]
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, vocab)
    if not with_logp:
        return flat, torch.zeros(0, dtype=torch.long, device=logits.device), lead
    check_tensor("labels", labels)
    if labels.shape != lead:
        raise ValueError(f"labels has shape {tuple(labels.shape)} but logits' leading shape is {tuple(lead)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    flat_labels = labels.reshape(-1).to(device=logits.device, dtype=torch.long)
    if flat_labels.numel() and (int(flat_labels.min()) < 0 or int(flat_labels.max()) >= vocab):
        raise ValueError(
            f"labels must lie in [0, {vocab}) (the vocab size), got min {int(flat_labels.min())} "
            f"max {int(flat_labels.max())}"
        )
    return flat, flat_labels, lead


def _run(logits, labels, temperature, chunk_size, with_logp, with_entropy, use_torch_compile=False,
         fixed_chunks=False, row_sum=None):
    flat, flat_labels, lead = flatten_checked(logits, labels, with_logp)
    t = normalize_temperature(temperature)
    chunk = _chunk_rows(chunk_size, logits.shape[-1])
    if (fixed_chunks or row_sum is not None) and use_torch_compile:
        raise ValueError("fixed_chunks / row_sum run the eager chunk loop; they cannot be combined with use_torch_compile")
    fns = compiled_chunk_fns() if use_torch_compile else None
    logp, ent = _ChunkedLogProbEntropy.apply(flat, flat_labels, t, chunk, with_logp, with_entropy, fns, fixed_chunks,
                                             row_sum)
    return (logp.reshape(lead) if logp is not None else None, ent.reshape(lead) if ent is not None else None)


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float | None = 1.0, chunk_size: int | None = None,
    *, use_torch_compile: bool = False, fixed_chunks: bool = False, row_sum: Callable | None = None,
) -> torch.Tensor:
    """`log_softmax(logits.float() / temperature)[labels]`, shape `logits.shape[:-1]`,
    memory-bounded and differentiable (see module docstring). `chunk_size` is in
    tokens (rows); None picks ~256 MiB of float32 per chunk. `use_torch_compile` runs
    the per-chunk math through `torch.compile` (module docstring). `fixed_chunks` pads the
    last chunk to `chunk_size` rows, so every reduction has one shape and a row's value
    does not depend on the other rows (true on-policy mode: verl_async.invariant.logprob). `row_sum`
    replaces the softmax denominator's `e.sum(-1)` ([rows, V] -> [rows]; the mode's exact sum on CPU)."""
    return _run(logits, labels, temperature, chunk_size, True, False, use_torch_compile, fixed_chunks, row_sum)[0]


def entropy_from_logits(
    logits: torch.Tensor, chunk_size: int | None = None, temperature: float | None = 1.0,
    *, use_torch_compile: bool = False,
) -> torch.Tensor:
    """Entropy of `softmax(logits.float() / temperature)` per token, chunked and
    differentiable."""
    return _run(logits, None, temperature, chunk_size, False, True, use_torch_compile)[1]


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float | None = 1.0, chunk_size: int | None = None,
    *, use_torch_compile: bool = False, fixed_chunks: bool = False, row_sum: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both in one pass over the logits (the trainer's usual call); the log-probs are those of
    `logprobs_from_logits` with the same arguments."""
    logp, ent = _run(logits, labels, temperature, chunk_size, True, True, use_torch_compile, fixed_chunks, row_sum)
    return logp, ent


def reference_logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float | None = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive full-vocabulary version (materialises N x V float32): the yardstick
    for tests and the micro-benchmark, not for training."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp_all = torch.log_softmax(logits.to(dtype) / normalize_temperature(temperature), dim=-1)
    logp = logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent
