"""FastDecoder (runner's few-kernel decode step) computes what the HF forward computes, per family.

Tiny random float32 models on CPU: llama (with/without attention bias, llama3 rope scaling, eager
attention), qwen2 (qkv bias; mixed sliding/full layers), qwen3 (q_norm/k_norm), mistral (sliding
window). Each runs a prefill, then decode steps through both paths on the same model: logits and
KV cache contents must agree, with rows at different positions and KV lengths padded (bucketed).
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from verl_async.rollout.engine import GenerateRequest, SamplingParams
from verl_async.rollout.native import NativeEngine
from verl_async.rollout.native.fast_decode import (
    FastDecoder,
    fast_decode_problem,
    rotate_half_matrix,
    rotation_matrices,
)
from verl_async.rollout.native.runner import ModelRunner
from verl_async.utils.device import resolve

pytestmark = pytest.mark.timeout(120)

SHAPE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
FAMILIES = {
    "llama": (LlamaConfig, {}, "sdpa"),
    "llama-bias-llama3rope-eager": (
        LlamaConfig, {"attention_bias": True, "mlp_bias": True, "rope_scaling": LLAMA3_ROPE}, "eager"
    ),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": True}, "sdpa"),
    "qwen2-sliding": (Qwen2Config, {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
                                    "num_hidden_layers": 3}, "sdpa"),
    "qwen3": (Qwen3Config, {}, "sdpa"),
    "qwen3-eager": (Qwen3Config, {"num_key_value_heads": 1}, "eager"),
    "mistral-sliding": (MistralConfig, {"sliding_window": 4}, "sdpa"),
}


def tiny(name: str) -> torch.nn.Module:
    cls, extra, impl = FAMILIES[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**SHAPE, **extra}), attn_implementation=impl)
    with torch.no_grad():  # random non-trivial norm weights and biases (HF initialises them to 1 / 0)
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval().requires_grad_(False)


def runner(model, fast: bool) -> ModelRunner:
    return ModelRunner(model, device=resolve("cpu"), num_slots=4, slot_len=48, fast_decode=fast)


def test_rotation_matrices_match_hf_rotary():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny("llama-bias-llama3rope-eager")
    rotary, dim = model.model.rotary_emb, 16
    torch.manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        q, k = torch.randn(5, 4, 1, dim, dtype=dtype), torch.randn(5, 2, 1, dim, dtype=dtype)
        positions = torch.tensor([0, 1, 7, 33, 100])
        cos, sin = rotary(q[:, 0, 0], positions[:, None])  # [B, 1, D]
        ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
        rot = rotation_matrices(cos, sin, *rotate_half_matrix(dim, dtype, torch.device("cpu")))
        got_q, got_k = torch.bmm(q[:, :, 0], rot), torch.bmm(k[:, :, 0], rot)
        assert (got_q.float() - ref_q[:, :, 0].float()).abs().max().item() <= tol
        assert (got_k.float() - ref_k[:, :, 0].float()).abs().max().item() <= tol


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fast_decode_matches_hf_forward(family):
    model = tiny(family)
    assert fast_decode_problem(model) is None
    fast, hf = runner(model, True), runner(model, False)
    assert isinstance(fast._fast, FastDecoder) and hf._fast is None
    prompts = [[3, 9, 27], [5, 6, 7, 8, 9, 10, 11], [100, 2, 64, 1, 40], [17]]
    slots = [0, 1, 2, 3]
    seqs = [list(p) for p in prompts]
    with torch.inference_mode():
        first = fast.prefill(prompts, slots).argmax(-1)
        assert torch.equal(hf.prefill(prompts, slots).argmax(-1), first)
        for r in (fast, hf):
            r.set_rows(slots, first, [len(p) for p in prompts])
        for seq, t in zip(seqs, first.tolist()):
            seq.append(t)
        worst = 0.0
        for step in range(9):
            rows = 4 if step < 6 else 3  # the last steps decode a smaller batch (rows at different positions)
            need = int(fast._pos[:rows].max()) + 1
            # exact KV length, or padded as graph buckets are (16-token buckets; once the whole slot)
            kv_len = need if step % 2 == 0 else 48 if step == 3 else -(-need // 16) * 16
            got = fast._forward_decode(fast._ids[:rows], fast._pos[:rows], kv_len)
            ref = hf._forward_decode(hf._ids[:rows], hf._pos[:rows], kv_len)
            assert got.dtype == torch.float32 and got.shape == (rows, 128)
            worst = max(worst, (got - ref).abs().max().item())
            tokens = ref.argmax(-1)
            for r in (fast, hf):
                r.advance(rows, tokens)
            for seq, t in zip(seqs, tokens.tolist()):
                seq.append(t)
        assert worst < 1e-5, worst
        for a, b in zip(fast.cache.k + fast.cache.v, hf.cache.k + hf.cache.v):
            assert (a - b).abs().max().item() < 1e-5
        # and the last step's logits are those of a plain full forward of each row's tokens (no cache)
        for row in range(3):
            full = model(torch.tensor([seqs[row][:-1]])).logits[0, -1].float()
            assert (full - got[row]).abs().max().item() < 1e-4


def test_engine_greedy_same_tokens_and_log_probs():
    model = tiny("llama")
    prompts = [[5, 9, 30, 41, 7], [100, 3], [17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27], [64]]

    async def generate(eng):
        try:
            reqs = [GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12 + 3 * i, ignore_eos=True))
                    for i, p in enumerate(prompts)]
            return await asyncio.gather(*[eng.generate(r) for r in reqs])
        finally:
            await eng.shutdown()

    engines = {
        True: NativeEngine(model=model, max_num_seqs=3, max_model_len=48),
        False: NativeEngine.from_config(
            {"max_num_seqs": 3, "max_model_len": 48, "enforce_eager": True,
             "engine_kwargs": {"native": {"fast_decode": False}}},
            model=model,
        ),
    }
    assert engines[True]._runner._fast is not None and engines[False]._runner._fast is None
    out = {k: asyncio.run(asyncio.wait_for(generate(e), 60)) for k, e in engines.items()}
    for a, b in zip(out[True], out[False]):
        assert a.ok and b.ok and a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs)) < 1e-5


def test_fast_decode_problem_names_unsupported_models(caplog):
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert "gpt2" in fast_decode_problem(gpt2)
    torch.manual_seed(0)
    tp2 = AutoModelForCausalLM.from_config(LlamaConfig(**{**SHAPE, "pretraining_tp": 2}), attn_implementation="sdpa")
    assert "pretraining_tp" in fast_decode_problem(tp2)
    with caplog.at_level(logging.INFO, logger="verl_async.rollout.native.runner"):
        assert runner(tp2.eval(), True)._fast is None
    assert any("fast decode off" in r.getMessage() and "pretraining_tp" in r.getMessage() for r in caplog.records)
    partial = tiny("llama")
    partial.model.rotary_emb.inv_freq = partial.model.rotary_emb.inv_freq[:4].clone()  # rotary dim 8 < head_dim 16
    assert "partial rotary" in fast_decode_problem(partial)
    with pytest.raises(ValueError, match="fast decode"):
        FastDecoder(gpt2, runner(tiny("llama"), False).cache, ["full_attention"])


FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def inside(param: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= param.data_ptr() < start + buffer.numel() * buffer.element_size()


def refit_and_compare(model, fast_runners, seed: int) -> None:
    """A WeightLoader refit of every q/k/v/gate/up weight (and bias) changes each fast step as it changes HF's."""
    from verl_async.rollout.native.weights import WeightLoader

    def addresses() -> list[int]:
        return [f.weight.data_ptr() for r in fast_runners for l in r._fast.layers for f in (l.qkv, l.gate_up) if f]

    before = addresses()
    torch.manual_seed(seed)
    update = {name: torch.randn_like(p) for name, p in model.named_parameters() if any(k in name for k in FUSED)}
    assert WeightLoader(model).load([update]) == len(update)
    assert addresses() == before  # refits land in the fused buffers, which stay where graphs captured them
    hf = runner(model, False)
    with torch.inference_mode():
        for r in (*fast_runners, hf):
            first = r.prefill([[3, 9, 27], [5, 6]], [0, 1]).argmax(-1)
            r.set_rows([0, 1], first, [3, 2])
        ref = hf._forward_decode(hf._ids[:2], hf._pos[:2], 4)
        for r in fast_runners:
            got = r._forward_decode(r._ids[:2], r._pos[:2], 4)
            assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", ["qwen2", "llama-bias-llama3rope-eager"])
def test_fused_projections_are_the_modules_parameters_and_follow_weight_updates(family):
    import gc
    import weakref

    model = tiny(family)
    count = sum(p.numel() for p in model.parameters())
    old = weakref.ref(model.model.layers[0].self_attn.q_proj.weight)
    fast = runner(model, True)
    gc.collect()
    assert old() is None  # the separate tensors are gone (no double memory)
    assert sum(p.numel() for p in model.parameters()) == count  # nothing duplicated
    for layer, hf_layer in zip(fast._fast.layers, model.model.layers):
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        assert layer.qkv is not None and layer.gate_up is not None
        for module in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert inside(module.weight, layer.qkv.weight)
            assert module.bias is None or inside(module.bias, layer.qkv.bias)
        for module in (mlp.gate_proj, mlp.up_proj):
            assert inside(module.weight, layer.gate_up.weight)
            assert module.bias is None or inside(module.bias, layer.gate_up.bias)
    refit_and_compare(model, [fast], seed=3)


def test_second_fast_decoder_on_one_model_shares_the_fused_buffers():
    # fusing again would move the parameters to a new buffer: the first decoder would miss refits
    model = tiny("qwen2")
    a, b = runner(model, True), runner(model, True)
    for la, lb in zip(a._fast.layers, b._fast.layers):
        assert la.qkv.weight.data_ptr() == lb.qkv.weight.data_ptr()
        assert la.qkv.bias.data_ptr() == lb.qkv.bias.data_ptr()
        assert la.gate_up.weight.data_ptr() == lb.gate_up.weight.data_ptr()
    refit_and_compare(model, [a, b], seed=4)


def test_fused_buffers_built_under_inference_mode_take_refits_outside_it():
    model = tiny("llama")
    with torch.inference_mode():
        fast = runner(model, True)
    assert not fast._fast.layers[0].qkv.weight.is_inference()
    refit_and_compare(model, [fast], seed=5)


def test_partial_qkv_bias_leaves_that_layer_unfused():
    model = tiny("llama-bias-llama3rope-eager")
    model.model.layers[1].self_attn.v_proj.bias = None  # q, k with bias, v without: no fused bias
    k_before = model.model.layers[1].self_attn.k_proj.weight
    fast = runner(model, True)
    assert fast._fast.layers[0].qkv is not None and fast._fast.layers[1].qkv is None
    assert fast._fast.layers[1].gate_up is not None
    assert model.model.layers[1].self_attn.k_proj.weight is k_before
    refit_and_compare(model, [fast], seed=6)


def test_fuse_projections_off_keeps_separate_parameters():
    model = tiny("qwen3")
    count = sum(p.numel() for p in model.parameters())
    q_before = model.model.layers[0].self_attn.q_proj.weight
    fast, hf = runner(model, False), runner(model, False)
    fast._fast = FastDecoder(model, fast.cache, fast.layer_types, fuse_projections=False)
    assert all(layer.qkv is None and layer.gate_up is None for layer in fast._fast.layers)
    assert model.model.layers[0].self_attn.q_proj.weight is q_before
    assert sum(p.numel() for p in model.parameters()) == count
    with torch.inference_mode():
        for r in (fast, hf):
            first = r.prefill([[3, 9, 27], [5, 6]], [0, 1]).argmax(-1)
            r.set_rows([0, 1], first, [3, 2])
        got = fast._forward_decode(fast._ids[:2], fast._pos[:2], 4)
        ref = hf._forward_decode(hf._ids[:2], hf._pos[:2], 4)
    assert (got - ref).abs().max().item() < 1e-5
