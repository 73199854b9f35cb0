"""HF <-> Megatron conversion, override checks and settings: pure functions, no megatron-core needed.

These layouts are where a silent error would hide (a transposed head, a swapped
gate/up half, a padded vocabulary row that leaks into the softmax), so each is
checked against an independent construction, for several TP sizes.
"""

from __future__ import annotations

import pytest
import torch
from verl_async.trainer.megatron.convert import (
    GATE_UP,
    QKV,
    ConversionError,
    HFCheckpoint,
    check_parallel,
    from_mcore_shards,
    hf_names,
    hf_tensors_from_megatron,
    model_spec,
    padded_vocab_size,
    param_map_for,
    param_maps,
    to_mcore_shard,
    unexpected_hf_tensors,
)
from verl_async.trainer.megatron.overrides import (
    OPT_KEY,
    TC_KEY,
    Platform,
    optimizer_overrides,
    sequence_parallel_allowed,
    transformer_overrides,
)
from verl_async.trainer.megatron.settings import MegatronSettings
from verl_async.trainer.settings import TrainerSettings


def _qwen2(**kw):
    from transformers import Qwen2Config

    base = dict(vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                architectures=["Qwen2ForCausalLM"])
    return Qwen2Config(**{**base, **kw})


def _random_hf(spec, seed=0) -> dict[str, torch.Tensor]:
    from verl_async.trainer.megatron.convert import expected_hf_shapes

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for pm in param_maps(spec):
        for name, shape in zip(pm.hf, expected_hf_shapes(spec, pm)):
            out[name] = torch.randn(*shape, generator=gen)
    return out


# ------------------------------------------------------------------ spec
def test_model_spec_reads_qwen2_llama_qwen3():
    from transformers import LlamaConfig, Qwen3Config

    q = model_spec(_qwen2())
    assert (q.arch, q.qkv_bias, q.qk_norm, q.head_dim, q.num_kv_heads) == ("qwen2", True, False, 4, 2)
    llama = model_spec(LlamaConfig(vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                   architectures=["LlamaForCausalLM"], rope_theta=5e5))
    assert (llama.arch, llama.qkv_bias, llama.head_dim, llama.rope_theta) == ("llama", False, 8, 5e5)
    q3 = model_spec(Qwen3Config(vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                architectures=["Qwen3ForCausalLM"]))
    assert (q3.qk_norm, q3.qkv_bias, q3.head_dim) == (True, False, 8)
    names = hf_names(q3)
    assert "model.layers.0.self_attn.q_norm.weight" in names and "model.layers.0.self_attn.q_proj.bias" not in names


def test_model_spec_refuses_what_megatron_cannot_reproduce():
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ConversionError, match="GPT2LMHeadModel.*not supported.*fsdp2"):
        model_spec(GPT2Config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ConversionError, match="hidden_act='gelu'"):
        model_spec(_qwen2(hidden_act="gelu"))
    with pytest.raises(ConversionError, match="mlp_bias"):
        model_spec(LlamaConfig(mlp_bias=True, architectures=["LlamaForCausalLM"]))
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 32}
    with pytest.raises(ConversionError, match="rope scaling"):
        model_spec(_qwen2(rope_parameters=yarn))
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 5e5}
    assert model_spec(LlamaConfig(rope_parameters=llama3, architectures=["LlamaForCausalLM"])).rope_scaling_factor == 8.0
    with pytest.raises(ConversionError, match="high_freq_factor=2.0"):
        model_spec(LlamaConfig(rope_parameters={**llama3, "high_freq_factor": 2.0}, architectures=["LlamaForCausalLM"]))


def test_parallel_divisibility_names_the_key():
    spec = model_spec(_qwen2())
    check_parallel(spec, tp=2, pp=2)
    with pytest.raises(ConversionError, match=r"tensor_model_parallel_size=4 does not divide .*num_key_value_heads=2"):
        check_parallel(spec, tp=4, pp=1)
    with pytest.raises(ConversionError, match=r"pipeline_model_parallel_size=3 .*num_hidden_layers=2"):
        check_parallel(spec, tp=1, pp=3)


# ------------------------------------------------------------------ tensors
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_roundtrip_is_bit_exact(tp, tied):
    spec = model_spec(_qwen2(tie_word_embeddings=tied, vocab_size=31))  # 31: padded for TP=2
    hf = _random_hf(spec)
    shards = {pm.mcore: [to_mcore_shard(spec, pm, [hf[n] for n in pm.hf], r, tp) for r in range(tp)]
              for pm in param_maps(spec)}
    back = hf_tensors_from_megatron(spec, shards)
    assert set(back) == set(hf) == set(hf_names(spec))
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    emb = shards["embedding.word_embeddings.weight"]
    assert sum(s.shape[0] for s in emb) == padded_vocab_size(31, tp)
    if tp == 2:
        assert torch.count_nonzero(emb[-1][-1]) == 0  # the padded row is zero
    assert ("output_layer.weight" in shards) == (not tied)


def test_qkv_layout_is_megatrons_per_group_order():
    """Independent construction: group g holds its query heads, then its key head, then its value head."""
    spec = model_spec(_qwen2(num_attention_heads=4, num_key_value_heads=2, hidden_size=8))
    hd, h = spec.head_dim, spec.hidden_size
    q = torch.arange(4 * hd * h, dtype=torch.float32).reshape(4 * hd, h)
    k = -torch.arange(2 * hd * h, dtype=torch.float32).reshape(2 * hd, h) - 1
    v = torch.arange(2 * hd * h, dtype=torch.float32).reshape(2 * hd, h) + 1000
    pm = param_map_for(spec, "decoder.layers.1.self_attention.linear_qkv.weight")
    assert pm.kind == QKV and pm.hf[0] == "model.layers.1.self_attn.q_proj.weight"
    expected = []
    for g in range(2):
        expected += [q[2 * g * hd:(2 * g + 2) * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    expected = torch.cat(expected)
    full = torch.cat([to_mcore_shard(spec, pm, [q, k, v], r, 2) for r in range(2)])
    assert torch.equal(full, expected)
    # TP rank r holds whole query groups: rank 1 starts with group 1's first query head
    assert torch.equal(to_mcore_shard(spec, pm, [q, k, v], 1, 2)[:hd], q[2 * hd:3 * hd])
    bias = param_map_for(spec, "decoder.layers.0.self_attention.linear_qkv.bias")
    qb, kb, vb = torch.randn(4 * hd), torch.randn(2 * hd), torch.randn(2 * hd)
    shards = [to_mcore_shard(spec, bias, [qb, kb, vb], r, 2) for r in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(from_mcore_shards(spec, bias, shards), [qb, kb, vb]))


def test_gate_up_is_split_per_tp_rank():
    spec = model_spec(_qwen2(intermediate_size=4, hidden_size=8))
    pm = param_map_for(spec, "decoder.layers.0.mlp.linear_fc1.weight")
    assert pm.kind == GATE_UP
    gate, up = torch.zeros(4, 8), torch.ones(4, 8)
    gate[:, 0] = torch.arange(4)
    up[:, 0] = torch.arange(4) + 10
    s0, s1 = (to_mcore_shard(spec, pm, [gate, up], r, 2) for r in range(2))
    # rank r: [its gate rows; its up rows] (SwiGLU chunks the local output in two)
    assert s0[:, 0].tolist() == [0, 1, 10, 11] and s1[:, 0].tolist() == [2, 3, 12, 13]
    g2, u2 = from_mcore_shards(spec, pm, [s0, s1])
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_row_parallel_splits_the_input_dim_and_bad_shapes_name_the_tensor():
    spec = model_spec(_qwen2())
    pm = param_map_for(spec, "decoder.layers.0.self_attention.linear_proj.weight")
    o = torch.randn(16, 16)
    assert torch.equal(to_mcore_shard(spec, pm, [o], 1, 2), o[:, 8:])
    with pytest.raises(ConversionError, match=r"o_proj.weight' has shape \(16, 8\), expected \(16, 16\)"):
        to_mcore_shard(spec, pm, [o[:, :8]], 0, 1)
    with pytest.raises(ConversionError, match="no HF source"):
        param_map_for(spec, "decoder.layers.0.mlp.router.weight")


def test_tied_last_stage_copy_maps_to_the_embedding():
    spec = model_spec(_qwen2(tie_word_embeddings=True))
    assert param_map_for(spec, "output_layer.weight").hf == ("model.embed_tokens.weight",)
    assert "lm_head.weight" not in hf_names(spec)
    assert unexpected_hf_tensors(spec, hf_names(spec) + ["lm_head.weight"]) == []
    assert unexpected_hf_tensors(spec, hf_names(spec) + ["model.layers.0.mlp.up_proj.bias"]) == \
        ["model.layers.0.mlp.up_proj.bias"]


def test_checkpoint_reader_reads_the_tiny_model(tiny_model_dir):
    from verl_async.models.loading import load_hf_config

    spec = model_spec(load_hf_config(tiny_model_dir))
    ckpt = HFCheckpoint(tiny_model_dir)
    assert unexpected_hf_tensors(spec, ckpt.names()) == []
    emb = ckpt.get("model.embed_tokens.weight")
    assert emb.shape == (spec.vocab_size, spec.hidden_size)
    with pytest.raises(ConversionError, match="has no tensor 'nope'"):
        ckpt.get("nope")


# ------------------------------------------------------------------ overrides
FIELDS = {"apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
          "gradient_accumulation_fusion", "deallocate_pipeline_outputs", "persist_layer_norm", "recompute_method",
          "num_layers", "tensor_model_parallel_size", "bf16"}
REFERENCE = {"apply_rope_fusion": True, "masked_softmax_fusion": True, "bias_activation_fusion": True,
             "bias_dropout_fusion": True, "gradient_accumulation_fusion": True, "deallocate_pipeline_outputs": True,
             "persist_layer_norm": True, "use_flash_attn": True}


def test_reference_fusions_on_a_plain_cuda_machine_turn_off_with_a_note():
    kwargs, notes = transformer_overrides(REFERENCE, FIELDS, Platform(device="cuda"))
    assert kwargs == {"bias_activation_fusion": True, "bias_dropout_fusion": True,
                      "deallocate_pipeline_outputs": True}
    assert len(notes) == 5
    assert any(n.startswith(f"{TC_KEY}.apply_rope_fusion=True turned off: no Transformer Engine") for n in notes)
    assert any("use_flash_attn" in n and "DotProductAttention" in n for n in notes)


def test_fusions_pass_when_their_kernels_exist_and_mindspeed_owns_npu():
    full = Platform(device="cuda", transformer_engine=True, apex=True, fused_softmax=True, grad_accum_fusion=True,
                    rope_fusion=True, fused_adam=True)
    kwargs, notes = transformer_overrides({k: v for k, v in REFERENCE.items() if k != "use_flash_attn"}, FIELDS, full)
    assert notes == [] and kwargs["apply_rope_fusion"] is True and kwargs["masked_softmax_fusion"] is True
    npu = Platform(device="npu", mindspeed=True)
    kwargs, notes = transformer_overrides(REFERENCE, FIELDS | {"use_flash_attn"}, npu)
    assert notes == [] and kwargs == REFERENCE


def test_override_errors_name_the_key():
    with pytest.raises(ValueError, match=rf"^{TC_KEY}\.apply_rope_fuson: unknown key.*did you mean \['apply_rope_fusion'"):
        transformer_overrides({"apply_rope_fuson": True}, FIELDS, Platform(device="cuda"))
    with pytest.raises(ValueError, match=rf"{TC_KEY}\.num_layers: set from the HF config"):
        transformer_overrides({"num_layers": 3}, FIELDS, Platform(device="cuda"))
    with pytest.raises(ValueError, match=rf"{TC_KEY}\.tensor_model_parallel_size: set by "
                                         r"actor_rollout_ref\.actor\.megatron\.tensor_model_parallel_size"):
        transformer_overrides({"tensor_model_parallel_size": 2}, FIELDS, Platform(device="cuda"))
    assert transformer_overrides({"apply_rope_fusion": False}, FIELDS, Platform(device="cpu")) == \
        ({"apply_rope_fusion": False}, [])


def test_reference_optimizer_overrides_without_fused_adam():
    fields = {"optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
              "use_precision_aware_optimizer", "lr"}
    ref = {"optimizer_offload_fraction": 0, "overlap_cpu_optimizer_d2h_h2d": True,
           "use_precision_aware_optimizer": True, "optimizer_cpu_offload": True}
    kwargs, notes = optimizer_overrides(ref, fields, Platform(device="cuda"))
    assert kwargs == {}
    assert sum(n.startswith(f"{OPT_KEY}.") for n in notes) == 4, notes
    kwargs, notes = optimizer_overrides(ref, fields, Platform(device="cuda", transformer_engine=True, fused_adam=True))
    assert kwargs == ref and notes == []
    with pytest.raises(ValueError, match=rf"{OPT_KEY}\.lr: set by actor_rollout_ref\.actor\.optim\.lr"):
        optimizer_overrides({"lr": 1.0}, fields, Platform(device="cuda"))


def test_sequence_parallel_needs_tp_and_a_norm_that_supports_it():
    assert sequence_parallel_allowed(True, 1, Platform(device="cuda")) == (False, None)
    on, note = sequence_parallel_allowed(True, 2, Platform(device="cuda", apex=True))
    assert not on and "RMSNorm" in note
    assert sequence_parallel_allowed(True, 2, Platform(device="npu", mindspeed=True)) == (True, None)


# ------------------------------------------------------------------ settings
def _megatron_config(tiny_model_dir, *overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from trainer_helpers import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose("fully_async_ppo_megatron_trainer",
                      overrides=[f"actor_rollout_ref.model.path={tiny_model_dir}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def test_settings_read_the_megatron_keys(tiny_model_dir):
    import verl_async.config  # noqa: F401 - registers the YAML's resolvers

    a = "actor_rollout_ref.actor"
    cfg = _megatron_config(tiny_model_dir, "trainer.n_gpus_per_node=4", f"{a}.megatron.tensor_model_parallel_size=2",
                           f"{a}.megatron.param_offload=true", f"{a}.optim.lr_decay_style=cosine",
                           f"{a}.optim.lr_decay_steps=10", f"{a}.optim.lr_warmup_steps=2",
                           "+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True")
    t = TrainerSettings.from_config(cfg)
    ms = MegatronSettings.from_config(cfg, t)
    assert (ms.tp, ms.pp, ms.model_parallel_size, ms.param_offload, ms.dtype) == (2, 1, 2, True, "bfloat16")
    assert ms.sequence_parallel  # asked for (YAML default) with TP > 1; the ranks decide whether it can run
    assert ms.override_transformer_config == {"apply_rope_fusion": True}
    assert ms.scheduler_steps(t) == (2, 10)


@pytest.mark.parametrize("override, match", [
    (["actor_rollout_ref.actor.megatron.context_parallel_size=2", "trainer.n_gpus_per_node=2"],
     "context_parallel_size=2: context parallelism needs Transformer Engine"),
    (["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"],
     "virtual_pipeline_model_parallel_size=2: the interleaved"),
    (["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2", "trainer.n_gpus_per_node=2"],
     "dense models only"),
    (["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"],
     r"ref\.megatron\.tensor_model_parallel_size=2 differs"),
    (["actor_rollout_ref.actor.optim.lr_decay_style=cosine"], r"optim\.lr_decay_steps .* must be > 0"),
])
def test_settings_errors_name_the_key(tiny_model_dir, override, match):
    import verl_async.config  # noqa: F401

    cfg = _megatron_config(tiny_model_dir, *override)
    t = TrainerSettings.from_config(cfg)
    with pytest.raises(ValueError, match=match):
        MegatronSettings.from_config(cfg, t).scheduler_steps(t)
