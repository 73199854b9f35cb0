"""The profile summary of a training step: pure categoriser and summary on hand-made events, then a real
CPU profile of a small model (module ranges reach the backward GEMMs through sequence numbers)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from verl_async.utils.profile_summary import (
    CATEGORIES,
    Record,
    categorize,
    extract_records,
    format_table,
    phase_of,
    profile_call,
    summarize,
)

FWD_MLP = ("verl::update", "verl::forward", "verl::module:mlp", "aten::linear", "aten::mm")
BWD_MLP = ("verl::backward", "verl::module:mlp", "autograd::engine::evaluate_function: MmBackward0", "MmBackward0",
           "aten::mm")
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>"


@pytest.mark.parametrize("name, ranges, expected", [
    # communication: NCCL kernels by name, gloo/c10d ops by name or range
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", ("verl::forward", "FSDP::all_gather"),
     "comm: all-gather"),
    ("ncclKernel_ReduceScatter_RING_LL_Sum_float", ("verl::backward", "FSDP::post_backward_reduce"),
     "comm: reduce-scatter"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", ("verl::grad_clip",), "comm: all-reduce"),
    ("c10d::_allgather_base_", ("verl::forward",), "comm: all-gather"),
    ("aten::copy_", ("verl::metrics", "c10d::allreduce_"), "comm: all-reduce"),
    ("ncclDevKernel_Broadcast_RING_LL", (), "comm: other"),
    ("Memcpy HtoD (Pageable -> Device)", ("verl::inputs", "aten::to", "aten::copy_"), "memcpy/memset"),
    ("Memset (Device)", ("verl::optimizer",), "memcpy/memset"),
    # attention kernels by name, in forward and backward; CPU sdpa ops by name or enclosing aten op
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4>>", ("verl::forward", "verl::module:self_attn"),
     "attention"),
    ("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>",
     ("verl::backward", "autograd::engine::evaluate_function: FlashAttentionBackward0"), "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", ("verl::backward",), "attention"),
    ("aten::empty", ("verl::forward", "verl::module:self_attn", "aten::scaled_dot_product_attention"), "attention"),
    # GEMMs by module, forward (module range) and backward (module inherited through the node)
    ("nvjet_tst_192x192_64x4_1x2_h_bz_coopB_TNT", FWD_MLP, "gemm: mlp"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", BWD_MLP, "gemm: mlp"),
    ("cutlass3x_sm90_tensorop_gemm_bf16", ("verl::forward", "verl::module:self_attn", "aten::addmm"),
     "gemm: attn proj"),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT", ("verl::forward", "verl::module:lm_head", "aten::mm"),
     "gemm: lm head"),
    ("aten::mm", ("verl::backward", "verl::module:lm_head"), "gemm: lm head"),
    ("aten::addmm", ("verl::forward",), "gemm: other"),
    # phases whose work is not GEMM / attention / communication
    (ELEMENTWISE, ("verl::logprob", "aten::exp_"), "logprob/entropy"),
    (ELEMENTWISE, ("verl::backward", "autograd::engine::evaluate_function: _ChunkedLogProbEntropyBackward"),
     "logprob/entropy"),
    (ELEMENTWISE, ("verl::loss", "aten::mul"), "loss"),
    ("void at::native::multi_tensor_apply_kernel<...>", ("verl::optimizer", "Optimizer.step#AdamW.step"),
     "optimizer"),
    ("void at::native::multi_tensor_apply_kernel<...>", ("Optimizer.step#AdamW.step",), "optimizer"),
    ("void at::native::lpnorm_cleanup<float>", ("verl::grad_clip", "aten::_foreach_norm"), "grad clip"),
    (ELEMENTWISE, ("verl::forward", "FSDP::pre_forward", "FSDP::all_gather_copy_out"), "fsdp copy/cast"),
    (ELEMENTWISE, ("verl::forward", "verl::module:mlp", "aten::silu"), "elementwise: mlp"),
    (ELEMENTWISE, ("verl::backward", "verl::module:self_attn"), "elementwise: self_attn"),
    ("void at::native::rms_norm_kernel", ("verl::forward",), "elementwise: other"),
    (ELEMENTWISE, (), "elementwise: other"),
])
def test_categorize(name, ranges, expected):
    assert expected in CATEGORIES
    assert categorize(name, ranges) == expected


def test_phase_is_the_innermost_trainer_range():
    assert phase_of(FWD_MLP) == "forward"  # verl::update and module ranges are not phases
    assert phase_of(BWD_MLP) == "backward"
    assert phase_of(("verl::update",)) == "other"
    assert phase_of(()) == "other"
    assert phase_of(("verl::bogus", "verl::loss", "aten::mul")) == "loss"


def test_summarize_totals_busy_union_and_idle_gap():
    records = [
        Record("nvjet_gemm", 10.0, 40.0, 30.0, FWD_MLP),
        Record("flash_fwd_kernel", 40.0, 60.0, 20.0, ("verl::forward", "verl::module:self_attn")),
        # NCCL beside compute: counted in the sum, not twice in the busy time
        Record("ncclDevKernel_AllGather_RING_LL", 30.0, 50.0, 20.0, ("verl::forward",)),
        Record("nvjet_gemm", 100.0, 150.0, 50.0, BWD_MLP),
        Record("multi_tensor_apply_kernel", 180.0, 190.0, 10.0, ("verl::optimizer",)),
        Record("late_kernel_outside_window", 300.0, 320.0, 20.0, ()),
    ]
    s = summarize(records, window_us=(0.0, 200.0), mode="cuda")
    assert s["wall_ms"] == pytest.approx(0.2)
    assert s["busy_ms"] == pytest.approx((50 + 50 + 10) / 1000)  # [10,60] + [100,150] + [180,190]
    assert s["idle_ms"] == pytest.approx(0.09)
    assert s["busy_frac"] == pytest.approx(0.55)
    assert s["kernel_ms"] == pytest.approx(0.13)  # 30 + 20 + 20 + 50 + 10 us
    assert s["categories"]["gemm: mlp"] == pytest.approx(0.08)
    assert s["categories"]["attention"] == pytest.approx(0.02)
    assert s["categories"]["comm: all-gather"] == pytest.approx(0.02)
    assert s["categories"]["optimizer"] == pytest.approx(0.01)
    assert list(s["categories"])[0] == "gemm: mlp"  # largest first
    assert s["phases"] == {"forward": pytest.approx(0.07), "backward": pytest.approx(0.05),
                           "optimizer": pytest.approx(0.01)}  # the late kernel is outside the window
    assert s["num_records"] == 5
    assert s["top"][0] == {"name": "nvjet_gemm", "ms": pytest.approx(0.08), "count": 2, "category": "gemm: mlp"}
    table = format_table(s, "unit")
    assert "gemm: mlp" in table and "idle gap 0.09 ms" in table and "CUDA kernel" in table


def test_summarize_empty():
    s = summarize([], window_us=(0.0, 0.0), mode="cpu")
    assert s["busy_ms"] == 0 and s["idle_ms"] == 0 and s["categories"] == {}
    assert "CPU op self" in format_table(s)


class _Block(torch.nn.Module):
    """Submodules named like an HF decoder layer's, so the module ranges attach to them."""

    def __init__(self, d: int):
        super().__init__()
        self.self_attn = torch.nn.Linear(d, 3 * d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.SiLU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        q, k, v = self.self_attn(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(1, 2).flatten(-2)
        return x + self.mlp(x)


class _Tiny(torch.nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList([_Block(d), _Block(d)])
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def test_cpu_profile_of_a_step(tmp_path):
    from torch.profiler import record_function

    from verl_async.algos import logprobs_from_logits

    torch.manual_seed(0)
    model = _Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 12))

    def step():
        with record_function("verl::forward"):
            logits = model(ids)
        with record_function("verl::logprob"):
            logp = logprobs_from_logits(logits[:, :-1], ids[:, 1:])
        with record_function("verl::backward"):
            (-logp.mean()).backward()
        with record_function("verl::optimizer"):
            opt.step()
            opt.zero_grad()
        return "done"

    trace = str(tmp_path / "prof" / "step_rank0.json.gz")
    summary, result = profile_call(step, device="cpu", model=model, trace_path=trace)
    assert result == "done"
    assert summary["mode"] == "cpu" and summary["trace"] == trace
    with gzip.open(trace, "rt") as f:
        assert json.load(f)["traceEvents"]
    cats = summary["categories"]
    for c in ("gemm: mlp", "gemm: attn proj", "gemm: lm head", "attention", "logprob/entropy", "optimizer"):
        assert cats.get(c, 0) > 0, (c, cats)
    assert set(summary["phases"]) >= {"forward", "logprob", "backward", "optimizer"}
    assert 0 < summary["busy_ms"] <= summary["wall_ms"]
    assert summary["idle_ms"] == pytest.approx(summary["wall_ms"] - summary["busy_ms"], abs=2e-3)
    # hooks are gone after the call: a second profile without `model` has no module ranges
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(ids).sum().backward()
    records, _, busy = extract_records(prof.events(), "cpu")
    assert busy is None
    assert not any(r.startswith("verl::module:") for rec in records for r in rec.ranges)


def test_backward_gemms_inherit_the_forward_module():
    model = _Tiny()
    ids = torch.randint(0, 64, (1, 8))
    from verl_async.utils.profile_summary import module_ranges

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with module_ranges(model):
            with torch.profiler.record_function("verl::forward"):
                out = model(ids)
        with torch.profiler.record_function("verl::backward"):
            out.sum().backward()
    records, (lo, hi), _ = extract_records(prof.events(), "cpu")
    assert hi > lo
    mm = [r for r in records if r.name in ("aten::mm", "aten::addmm")]
    by = {}
    for r in mm:
        by.setdefault((phase_of(r.ranges), categorize(r.name, r.ranges)), 0)
        by[(phase_of(r.ranges), categorize(r.name, r.ranges))] += 1
    # forward: 2 layers x (qkv + 2 mlp) + lm head; backward: each of them again (input and weight grads)
    assert by[("forward", "gemm: mlp")] == 4 and by[("forward", "gemm: attn proj")] == 2
    assert by[("forward", "gemm: lm head")] == 1
    assert by[("backward", "gemm: mlp")] >= 4 and by[("backward", "gemm: attn proj")] >= 2
    assert by[("backward", "gemm: lm head")] >= 1
    assert ("backward", "gemm: other") not in by


def _evt(name, start, end, *, thread=1, parent=None, seq=-1, fwd_thread=0, kernels=(), device=None,
         activity=None, annotation=False):
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Kernel

    return SimpleNamespace(
        name=name, time_range=SimpleNamespace(start=float(start), end=float(end)), thread=thread, cpu_parent=parent,
        sequence_nr=seq, fwd_thread=fwd_thread, kernels=[Kernel(k, 0, d) for k, d in kernels],
        device_type=device or DeviceType.CPU, is_async=False, activity_type=activity or ("cpu_op" if device is None
                                                                                        else "kernel"),
        is_user_annotation=annotation, self_cpu_time_total=float(end - start),
    )


def test_cuda_events_kernels_on_their_launching_op_and_backward_thread():
    """Hand-made CUDA profile: kernels hang on their launching op (FunctionEvent.kernels), backward runs on
    the autograd thread (phase by time, module by the forward op's sequence number), GPU annotations and
    sync waits are not device work, the window runs to the last kernel's end."""
    from torch.autograd import DeviceType

    a = dict(annotation=True, activity="user_annotation")
    update = _evt("verl::update", 0, 1000, **a)
    fwd = _evt("verl::forward", 10, 200, parent=update, kernels=[("verl::forward", 190)], **a)
    mlp = _evt("verl::module:mlp", 20, 100, parent=fwd, **a)
    linear = _evt("aten::linear", 30, 60, parent=mlp, seq=7)
    mm = _evt("aten::mm", 35, 55, parent=linear, seq=7, kernels=[("nvjet_tst_fwd", 40)])
    bwd = _evt("verl::backward", 300, 900, parent=update, **a)
    node = _evt("autograd::engine::evaluate_function: MmBackward0", 310, 400, thread=2, seq=7, fwd_thread=1)
    inner = _evt("MmBackward0", 312, 398, thread=2, parent=node, seq=7, fwd_thread=1)
    mm_b = _evt("aten::mm", 320, 390, thread=2, parent=inner, kernels=[("nvjet_tst_bwd", 60), ("nvjet_tst_bwd", 60)])
    opt = _evt("verl::optimizer", 910, 990, parent=update, **a)
    step = _evt("Optimizer.step#AdamW.step", 912, 988, parent=opt, **a)
    foreach = _evt("aten::_foreach_add_", 920, 930, parent=step, kernels=[("multi_tensor_apply_kernel", 20)])
    gpu = [
        _evt("verl::forward", 10, 200, device=DeviceType.CUDA, activity="gpu_user_annotation"),
        _evt("nvjet_tst_fwd", 50, 90, device=DeviceType.CUDA),
        _evt("nvjet_tst_bwd", 330, 390, device=DeviceType.CUDA),
        _evt("nvjet_tst_bwd", 395, 455, device=DeviceType.CUDA),
        _evt("Event Sync", 455, 900, device=DeviceType.CUDA, activity="cuda_sync"),
        _evt("multi_tensor_apply_kernel", 950, 970, device=DeviceType.CUDA),
        _evt("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 990, 1100, device=DeviceType.CUDA),  # no launching op here
    ]
    events = [update, fwd, mlp, linear, mm, bwd, node, inner, mm_b, opt, step, foreach, *gpu]
    records, window, busy = extract_records(events, "cuda")
    assert window == (0.0, 1100.0)
    assert sorted((r.name, categorize(r.name, r.ranges), phase_of(r.ranges)) for r in records) == [
        ("multi_tensor_apply_kernel", "optimizer", "optimizer"),
        ("nvjet_tst_bwd", "gemm: mlp", "backward"), ("nvjet_tst_bwd", "gemm: mlp", "backward"),
        ("nvjet_tst_fwd", "gemm: mlp", "forward"),
    ]
    s = summarize(records, window_us=window, mode="cuda", busy_intervals=busy)
    assert s["categories"] == {"gemm: mlp": pytest.approx(0.16), "optimizer": pytest.approx(0.02)}
    assert s["busy_ms"] == pytest.approx((40 + 60 + 60 + 20 + 110) / 1000)
    assert s["wall_ms"] == pytest.approx(1.1) and s["idle_ms"] == pytest.approx(0.81)
