"""True on-policy mode's decode step (rollout/native/invariant_decode.py) has the bits of the HF forward it replaces.

The HF forward in the mode is what the trainer runs (tests/trainer/test_true_on_policy*.py hold the engine to the
trainer end to end); here the short path is held to it op for op, every family the mode admits, float32 and bf16
on CPU (exact sums), and with the Triton kernels under Triton's interpreter (the CUDA path's wiring: cache views,
strides, the rotary kernel's cache writes). The step is the function the runner captures as a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from tests.rollout.test_native_fast_decode import FAMILIES, tiny
from tests.triton_interpreter import PREIMPORTED, fresh_process_only, run_in_fresh_process
from verl_async.invariant import triton_ops
from verl_async.rollout.native.invariant_decode import InvariantDecoder
from verl_async.rollout.native.runner import ModelRunner
from verl_async.utils.device import resolve

pytestmark = pytest.mark.timeout(300)

SPAN = 64
MODE_FAMILIES = sorted(f for f in FAMILIES if not f.endswith("eager"))  # the mode sets its own attention


def _runners(family: str, dtype: torch.dtype):
    model = tiny(family)  # one model: the patch is the same for both, the caches are their own
    for param in model.parameters():  # the weights in dtype, rotary tables in float32 (as load_causal_lm keeps them)
        param.data = param.data.to(dtype)
    make = lambda fast: ModelRunner(model, device=resolve("cpu"), num_slots=4, slot_len=SPAN, fast_decode=fast,
                                    true_on_policy_span=SPAN)
    return make(True), make(False)


def _same_steps(fast: ModelRunner, hf: ModelRunner, steps: int = 7, bucket: int = 0) -> None:
    """Prefill 4 prompts into both runners, then `steps` decode steps (the last ones with 3 rows): logits and
    caches equal at every step (`bucket`: key lengths padded as the graph buckets pad them)."""
    prompts = [[3, 9, 27], [5, 6, 7, 8, 9, 10, 11], [100, 2, 64, 1, 40], [17]]
    slots = [0, 1, 2, 3]
    with torch.inference_mode():
        first = fast.prefill(prompts, slots)
        assert torch.equal(first, hf.prefill(prompts, slots))
        tokens = first.argmax(-1)
        for r in (fast, hf):
            r.set_rows(slots, tokens, [len(p) for p in prompts])
        for step in range(steps):
            rows = 4 if step < steps - 2 else 3
            need = int(fast._pos[:rows].max()) + 1
            kv_len = -(-need // bucket) * bucket if bucket else need
            got = fast._forward_decode(fast._ids[:rows], fast._pos[:rows], kv_len)
            want = hf._forward_decode(hf._ids[:rows], hf._pos[:rows], kv_len)
            assert got.dtype == torch.float32 and torch.equal(got, want), (step, (got - want).abs().max())
            tokens = want.argmax(-1)
            for r in (fast, hf):
                r.advance(rows, tokens)
        for a, b in zip(fast.cache.k + fast.cache.v, hf.cache.k + hf.cache.v):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", MODE_FAMILIES)
def test_the_short_step_has_the_hf_forwards_bits(family, dtype):
    fast, hf = _runners(family, dtype)
    assert isinstance(fast._fast, InvariantDecoder) and hf._fast is None
    assert not fast._fast.rope_kernel and fast._fast.layers[0].qkv is None  # CPU: HF's rotary, the modules
    if family == "qwen2-sliding":  # layer 0 full, layers 1.. sliding (max_window_layers=1), as HF hands them
        assert fast._fast.windows == [None, 4, 4]
    if family == "mistral-sliding":
        assert fast._fast.windows == [4, 4]
    _same_steps(fast, hf, bucket=16 if dtype == torch.bfloat16 else 0)


def test_fused_projections_serve_only_where_their_columns_are_the_modules_outputs():
    from verl_async.invariant.attention import ATTENTION_NAME
    from verl_async.rollout.native.fast_decode import FastDecoder
    from verl_async.rollout.native.invariant_decode import _fusion_problem

    hf = _runners("qwen2", torch.float32)[1]  # patched (the mode's modules), q/k/v with biases
    fused = FastDecoder(hf.model, hf.cache, hf.layer_types, fuse_projections=True, attention=(ATTENTION_NAME,))
    # (on CPU the projections only: the residual added inside the launch is the Triton kernel's, checked below)
    assert fused.layers[0].qkv is not None and _fusion_problem(fused.layers, residual=False) is None
    layer = fused.layers[1]
    shifted = layer._replace(gate_up=layer.gate_up._replace(weight=layer.gate_up.weight.roll(1, dims=0)))
    assert _fusion_problem([fused.layers[0], shifted], residual=False) == (
        "layer 1: a fused projection's columns differ from its modules' outputs")


@pytest.mark.skipif(PREIMPORTED, reason="triton was imported without the interpreter")
@pytest.mark.parametrize("family", ["qwen2-sliding", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_with_the_triton_kernels_too(family, monkeypatch):
    """CUDA's path on CPU under Triton's interpreter: linear, RMSNorm, attention and the rotary kernel (which also
    writes K/V into the cache) in both the short step and the HF forward, over the whole span as on CUDA. qwen2 with
    sliding layers: biases and windows; qwen3 (slow: the interpreter is slow): q_norm and k_norm."""
    pytest.importorskip("triton")
    monkeypatch.setattr(triton_ops, "use_triton", lambda device: True)
    fast, hf = _runners(family, torch.bfloat16)
    assert fast._fast.rope_kernel, fast._fast.rope_problem
    # q/k/v and gate/up one launch each, the residual adds inside o_proj's and down_proj's
    assert fast._fast.fusion_problem is None and fast._fast.layers[0].qkv is not None and fast._fast.fuse_residual
    _same_steps(fast, hf, steps=4, bucket=SPAN)


@fresh_process_only
def test_with_the_triton_kernels_in_a_fresh_process():
    run_in_fresh_process(f"{__file__}::test_with_the_triton_kernels_too", timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2-sliding"])
def test_the_captured_step_on_cuda_has_the_hf_forwards_bits(family):
    """On a GPU: the short step replayed from the runner's CUDA graphs (batch buckets, padded rows) against the
    HF forward run eagerly, bf16, every step and the caches bitwise; the rotary kernel in use (its probe passed)."""
    model = tiny(family).to("cuda")
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    make = lambda fast, graphs: ModelRunner(model, device=resolve("cuda"), num_slots=8, slot_len=SPAN,
                                            fast_decode=fast, cuda_graphs=graphs, true_on_policy_span=SPAN)
    fast, hf = make(True, True), make(False, False)
    assert fast.static_decode and isinstance(fast._fast, InvariantDecoder)
    assert fast._fast.rope_kernel, fast._fast.rope_problem
    assert fast._fast.fusion_problem is None, fast._fast.fusion_problem
    prompts = [[3, 9, 27], [5, 6, 7, 8, 9, 10, 11], [100, 2, 64, 1, 40], [17], [8, 8]]
    slots = list(range(len(prompts)))
    with torch.inference_mode():
        tokens = fast.prefill(prompts, slots).argmax(-1)
        for r in (fast, hf):
            r.set_rows(slots, tokens, [len(p) for p in prompts])
        for step in range(12):
            rows = 5 if step < 8 else 3  # 5 rows replay the batch-8 graph (3 padding rows), then the batch-4 one
            top = int(fast._pos[:rows].max())
            got, want = fast.decode(rows, top).clone(), hf.decode(rows, top)
            assert torch.equal(got, want), (step, (got - want).abs().max())
            tokens = want.argmax(-1)
            for r in (fast, hf):
                r.advance(rows, tokens)
        assert fast.graphs_captured >= 2
        for a, b in zip(fast.cache.k + fast.cache.v, hf.cache.k + hf.cache.v):
            assert torch.equal(a[:3], b[:3])  # (slots 3, 4 were padding rows of the last graphs: written again)
