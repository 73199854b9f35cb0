"""Where a training step's time goes: a torch.profiler run summarised by category.

    summary, result = profile_call(fn, device="cuda", model=model, trace_path="prof/step_rank0.json.gz")

runs `fn()` once under torch.profiler (CPU + CUDA activities on cuda, CPU alone
elsewhere; no shapes, no stacks), with `record_function` ranges around the model's
`self_attn`, `mlp`, `lm_head` and `embed_tokens` modules (forward hooks, installed only
for that call), writes a gzipped Chrome trace, and returns a summary:

* `categories`: device time (CUDA kernel time; on CPU, CPU op self time) per category
  (attention, GEMMs of the MLP / attention projections / LM head, log-prob + entropy,
  loss, optimizer, grad clipping, communication, FSDP copies, memcpy/memset,
  elementwise by module) — `categorize(name, ranges)`;
* `phases`: the same time per phase of the step (the `verl::*` ranges the trainer opens
  around inputs, forward, log-prob, loss, backward, grad clip, optimizer) — `phase_of`;
* `wall_ms` of the step, `busy_ms` (union of device-busy intervals), `idle_ms` (wall
  minus busy: host gaps, launch latency, syncs), `kernel_ms` (sum; more than busy when
  streams overlap, e.g. NCCL beside compute), the top kernels.

Backward kernels run on the autograd thread, outside the forward's module ranges: the
profiler's sequence numbers link each `autograd::engine::evaluate_function: XBackward0`
to the forward op that made its node, and the backward kernel inherits that op's
module ranges (so a backward GEMM of the MLP counts as `gemm: mlp`). The phase of an
op outside any `verl::` range on its own thread is the main-thread phase open at its
start (the backward phase for autograd-thread work).

`categorize`, `phase_of` and `summarize` are pure (plain records in, dicts out);
`extract_records` is the adapter from torch.profiler events.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from verl_async.utils.timeline import union_length

# Phase ranges the trainer opens (verl_async/trainer/fsdp_worker.py), and the whole call.
STEP_RANGE = "verl::update"
PHASES = ("inputs", "forward", "logprob", "loss", "backward", "grad_clip", "optimizer", "metrics")
PHASE_PREFIX = "verl::"
MODULE_PREFIX = "verl::module:"
# Submodule (attribute) names that get a range: HF decoder models name them so (Qwen2, Llama, Mistral, ...).
MODULE_NAMES = ("self_attn", "mlp", "lm_head", "embed_tokens")

CATEGORIES = (
    "attention", "gemm: mlp", "gemm: attn proj", "gemm: lm head", "gemm: other", "logprob/entropy", "loss",
    "optimizer", "grad clip", "comm: all-gather", "comm: reduce-scatter", "comm: all-reduce", "comm: other",
    "fsdp copy/cast", "memcpy/memset", "elementwise: mlp", "elementwise: self_attn", "elementwise: other",
)

_COMM = re.compile(r"nccl|gloo|c10d::|allgather|all_gather|reducescatter|reduce_scatter|allreduce|all_reduce|"
                   r"broadcast|sendrecv|record_param_comms", re.I)
_ATTENTION = re.compile(r"flash|fmha|scaled_dot_product|sdpa|varlen_attn|efficient_attention|"
                        r"cudnn.*(mha|attn)|\battention\b|_attention", re.I)
_MEM = re.compile(r"^\s*mem(cpy|set)\b", re.I)
_GEMM_KERNEL = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|\bsm\d+_|ampere_|hopper_|volta_|turing_|"
                          r"splitk|matmul", re.I)
_GEMM_OP = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_scaled_mm|addmv|mv|dot)$")
_LOGPROB_BACKWARD = re.compile(r"LogProb|Entropy", re.I)
_EVALUATE = "autograd::engine::evaluate_function"


def _comm_kind(text: str) -> str:
    t = text.lower().replace("_", "")
    if "allgather" in t:
        return "comm: all-gather"
    if "reducescatter" in t:
        return "comm: reduce-scatter"
    if "allreduce" in t:
        return "comm: all-reduce"
    return "comm: other"


def _module(ranges: Sequence[str]) -> Optional[str]:
    """The innermost module range (`verl::module:mlp` -> 'mlp')."""
    for r in reversed(ranges):
        if r.startswith(MODULE_PREFIX):
            return r[len(MODULE_PREFIX):]
    return None


def phase_of(ranges: Sequence[str]) -> str:
    """The innermost `verl::<phase>` range of an event's enclosing ranges (outermost first); 'other' if none."""
    for r in reversed(ranges):
        if r.startswith(PHASE_PREFIX) and not r.startswith(MODULE_PREFIX):
            name = r[len(PHASE_PREFIX):]
            if name in PHASES:
                return name
    return "other"


def categorize(name: str, ranges: Sequence[str] = ()) -> str:
    """Category of one device kernel (or, on CPU, one op's self time).

    `name`: the kernel's name (CPU: the op's name); `ranges`: the names of the profiler
    events enclosing its launch, outermost first: trainer phases (`verl::backward`),
    module ranges (`verl::module:mlp`), torch's own ranges (`FSDP::post_backward_reduce`,
    `Optimizer.step#AdamW.step`, `autograd::engine::evaluate_function: MmBackward0`) and
    the aten ops down to the one that launched it (`aten::mm`).
    """
    ranges = tuple(ranges)
    innermost = ranges[-1] if ranges else ""
    if _COMM.search(name):
        return _comm_kind(name)
    if _MEM.search(name):
        return "memcpy/memset"
    # a communication op's own launches (NCCL kernels match above; this catches gloo and c10d wrappers on CPU)
    for r in reversed(ranges):
        if r.startswith("c10d::") or r.startswith("nccl:") or r.startswith("gloo:") or r == "record_param_comms":
            return _comm_kind(r)
    if _ATTENTION.search(name) or any(_ATTENTION.search(r) for r in ranges if r.startswith("aten::")):
        return "attention"
    phase = phase_of(ranges)
    if phase == "optimizer" or any(r.startswith("Optimizer.step") for r in ranges):
        return "optimizer"
    if phase == "grad_clip":
        return "grad clip"
    if any(r.startswith("FSDP::") for r in ranges):
        return "fsdp copy/cast"
    module = _module(ranges)
    if _GEMM_KERNEL.search(name) or _GEMM_OP.match(name) or _GEMM_OP.match(innermost):
        return {"mlp": "gemm: mlp", "self_attn": "gemm: attn proj", "lm_head": "gemm: lm head"}.get(module,
                                                                                                  "gemm: other")
    if phase == "logprob" or any(r.startswith(_EVALUATE) and _LOGPROB_BACKWARD.search(r)
                                 for r in ranges):
        return "logprob/entropy"
    if phase == "loss":
        return "loss"
    if module in ("mlp", "self_attn"):
        return f"elementwise: {module}"
    return "elementwise: other"


@dataclass(frozen=True)
class Record:
    """One unit of device time: a kernel (CUDA) or an op's self time (CPU).

    `start_us`/`end_us`: the interval the device (CUDA: the GPU; CPU: the op) was busy
    with it, `time_us` the time it is charged (CUDA: the kernel's duration; CPU: self
    time, children excluded), `ranges` its enclosing ranges, outermost first.
    """

    name: str
    start_us: float
    end_us: float
    time_us: float
    ranges: tuple[str, ...] = ()


def summarize(records: Sequence[Record], *, window_us: tuple[float, float], mode: str, top: int = 12,
              busy_intervals: Optional[Sequence[tuple[float, float]]] = None) -> dict:
    """Totals per category and phase, busy time and idle gap over `window_us` (the step's start and end).

    Busy time is the union of `busy_intervals` (CUDA: the GPU's kernel / memcpy / memset
    intervals) or, without them, of the records' own intervals (CPU ops). Records that
    start at or after the window's end are left out.
    """
    lo, hi = window_us
    wall = max(hi - lo, 0.0)
    records = [r for r in records if r.start_us < hi and (r.end_us > lo or r.start_us >= lo)]
    cats: dict[str, float] = {}
    phases: dict[str, float] = {}
    counts: dict[str, int] = {}
    kernels: dict[tuple[str, str], list] = {}
    for r in records:
        c = categorize(r.name, r.ranges)
        cats[c] = cats.get(c, 0.0) + r.time_us
        p = phase_of(r.ranges)
        phases[p] = phases.get(p, 0.0) + r.time_us
        counts[p] = counts.get(p, 0) + 1
        k = kernels.setdefault((r.name, c), [0.0, 0])
        k[0] += r.time_us
        k[1] += 1
    if busy_intervals is None:
        busy_intervals = [(r.start_us, r.end_us) for r in records]
    busy = union_length(busy_intervals, lo, hi)
    total = sum(cats.values())
    ms = lambda us: round(us / 1000.0, 3)  # noqa: E731
    return {
        "mode": mode,
        "wall_ms": ms(wall),
        "busy_ms": ms(busy),
        "idle_ms": ms(wall - busy),
        "busy_frac": round(busy / wall, 4) if wall > 0 else 0.0,
        "kernel_ms": ms(total),
        "num_records": len(records),
        "categories": {c: ms(v) for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "phases": {p: ms(v) for p, v in sorted(phases.items(), key=lambda kv: -kv[1])},
        "records_by_phase": {p: counts[p] for p in sorted(counts, key=lambda p: -phases[p])},
        "top": [{"name": n[:120], "ms": ms(v[0]), "count": v[1], "category": c}
                for (n, c), v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def format_table(summary: dict, title: str = "") -> str:
    """Human table of one summary (category and phase shares of device time, then wall / busy / idle)."""
    unit = "CUDA kernel" if summary["mode"] == "cuda" else "CPU op self"
    total = summary["kernel_ms"] or 1.0
    lines = [f"{title} ({unit} time; {summary['num_records']} records)".strip()]
    lines.append(f"  {'category':<24} {'ms':>10} {'share':>6}   {'phase':<10} {'ms':>10} {'share':>6}")
    cats, phases = list(summary["categories"].items()), list(summary["phases"].items())
    for i in range(max(len(cats), len(phases))):
        left = f"{cats[i][0]:<24} {cats[i][1]:>10.2f} {100 * cats[i][1] / total:>5.1f}%" if i < len(cats) else " " * 42
        right = (f"{phases[i][0]:<10} {phases[i][1]:>10.2f} {100 * phases[i][1] / total:>5.1f}%"
                 if i < len(phases) else "")
        lines.append(f"  {left}   {right}".rstrip())
    lines.append(f"  wall {summary['wall_ms']:.2f} ms | device busy (union) {summary['busy_ms']:.2f} ms "
                 f"({100 * summary['busy_frac']:.1f}%) | idle gap {summary['idle_ms']:.2f} ms | "
                 f"kernel sum {summary['kernel_ms']:.2f} ms")
    for k in summary.get("top", [])[:8]:
        lines.append(f"    {k['ms']:>9.2f} ms x{k['count']:<6} [{k['category']}] {k['name'][:90]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- torch.profiler adapter
def _chain(evt) -> list[str]:
    names = []
    p = evt.cpu_parent
    while p is not None:
        names.append(p.name)
        p = p.cpu_parent
    return names[::-1]


_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
_DEVICE_SYNC = re.compile(r"^(stream|event|context|device) ?(sync|wait)", re.I)


def _is_device_work(e) -> bool:
    """A GPU event that occupies the device: kernels, memcpy, memset (not annotations or sync waits)."""
    kind = getattr(e, "activity_type", None)
    if kind:
        return kind in _DEVICE_WORK
    return not e.is_user_annotation and not _DEVICE_SYNC.search(e.name)


def extract_records(events, mode: str) -> tuple[list[Record], tuple[float, float], Optional[list]]:
    """(records, step window, device busy intervals or None) from `prof.events()`.

    mode 'cuda': one record per kernel (also memcpy / memset) that the profiler attached to
    the CPU op launching it (`FunctionEvent.kernels`), its ranges those of that op plus the
    op itself, placed at the op's start; the busy intervals are the GPU events' own.
    Other modes: one record per CPU op (user annotations excluded), charged with its self
    time; busy time then comes from the records.
    """
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    chains = {id(e): _chain(e) for e in cpu}
    # forward module ranges by (thread, sequence number), for the backward ops of those nodes
    modules_of: dict[tuple[int, int], tuple[str, ...]] = {}
    for e in cpu:
        if e.sequence_nr is not None and e.sequence_nr >= 0 and not e.name.startswith("autograd::"):
            mods = tuple(r for r in chains[id(e)] if r.startswith(MODULE_PREFIX))
            key = (e.thread, e.sequence_nr)
            if mods and key not in modules_of:
                modules_of[key] = mods
    # main-thread phases by time, for ops on other threads (autograd's device threads)
    phase_spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in cpu
                         if e.name.startswith(PHASE_PREFIX) and phase_of((e.name,)) != "other")
    starts = [s for s, _, _ in phase_spans]
    step = [e for e in cpu if e.name == STEP_RANGE]

    def phase_at(t: float) -> tuple[str, ...]:
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0:  # phases do not nest; the walk back only skips ranges of other threads' lookups
            s, u, name = phase_spans[i]
            if s <= t <= u:
                return (name,)
            i -= 1
        return ()

    def ranges_of(e) -> tuple[str, ...]:
        chain = tuple(chains[id(e)])
        mods: tuple[str, ...] = ()
        if not any(c.startswith(MODULE_PREFIX) for c in chain):
            node = next((p for p in (e, *_parents(e)) if p.name.startswith(_EVALUATE)), None)
            if node is not None:
                mods = modules_of.get((node.fwd_thread, node.sequence_nr), ())
        head = phase_at(e.time_range.start) if phase_of(chain) == "other" else ()
        return head + mods + chain  # a node's module ranges enclose its ops, outermost first

    records: list[Record] = []
    busy: Optional[list] = None
    if mode == "cuda":
        for e in cpu:
            kernels = [k for k in e.kernels if k.name != e.name]  # a GPU-side copy of a user annotation
            if kernels:
                ranges = ranges_of(e) + (e.name,)
                t = e.time_range.start
                records.extend(Record(k.name, t, t, float(k.duration), ranges) for k in kernels)
        busy = [(e.time_range.start, e.time_range.end) for e in events
                if e.device_type != DeviceType.CPU and _is_device_work(e)]
    else:
        for e in cpu:
            if e.is_user_annotation or e.name.startswith(PHASE_PREFIX):
                continue
            records.append(Record(e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total,
                                  ranges_of(e)))
    spans = busy if busy is not None else [(r.start_us, r.end_us) for r in records]
    if step:
        lo, hi = step[0].time_range.start, step[-1].time_range.end
        if busy is not None:  # kernels queued by the step finish after its host range
            hi = max([hi] + [e for s, e in busy if s >= lo])
    else:
        lo = min((s for s, _ in spans), default=0.0)
        hi = max((e for _, e in spans), default=0.0)
    return records, (lo, hi), busy


def _parents(e):
    p = e.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


@contextlib.contextmanager
def module_ranges(model, names: Sequence[str] = MODULE_NAMES):
    """`record_function('verl::module:<name>')` around every submodule whose attribute name is in `names`."""
    import torch

    handles, stacks = [], {}

    def pre(mod, *_):
        rf = torch.profiler.record_function(MODULE_PREFIX + mod._verl_profile_name)
        rf.__enter__()
        stacks.setdefault(id(mod), []).append(rf)

    def post(mod, *_):
        stack = stacks.get(id(mod))
        if stack:
            stack.pop().__exit__(None, None, None)

    for qual, mod in model.named_modules():
        leaf = qual.rsplit(".", 1)[-1]
        if leaf in names:
            mod._verl_profile_name = leaf
            handles.append(mod.register_forward_pre_hook(pre))
            handles.append(mod.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def profile_call(fn: Callable[[], Any], *, device: str, model=None, trace_path: Optional[str] = None,
                 ) -> tuple[dict, Any]:
    """Run `fn()` once under torch.profiler; (summary, fn's result). See the module docstring."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    mode = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if mode == "cuda" else [])
    sync = torch.cuda.synchronize if mode == "cuda" else (lambda: None)
    ctx = module_ranges(model) if model is not None else contextlib.nullcontext()
    sync()
    with profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False) as prof:
        with ctx:
            t = time.perf_counter()
            with record_function(STEP_RANGE):
                result = fn()
            sync()
            host_s = time.perf_counter() - t
    t = time.perf_counter()
    records, window, busy = extract_records(prof.events(), mode)
    summary = summarize(records, window_us=window, mode=mode, busy_intervals=busy)
    if busy is not None:  # device time the profiler could not tie to a launching op
        lo, hi = window
        device_ms = sum(min(e, hi) - max(s, lo) for s, e in busy if e > lo and s < hi) / 1000.0
        summary["unattributed_ms"] = round(max(device_ms - summary["kernel_ms"], 0.0), 3)
    summary["host_wall_ms"] = round(host_s * 1000, 3)
    if trace_path:
        os.makedirs(os.path.dirname(os.path.abspath(trace_path)) or ".", exist_ok=True)
        prof.export_chrome_trace(trace_path)  # a .gz path is gzipped by torch
        summary["trace"] = trace_path
        summary["trace_mb"] = round(os.path.getsize(trace_path) / 2**20, 2)
    summary["summary_s"] = round(time.perf_counter() - t, 2)
    return summary, result
