import pytest
import torch

from verl_async.models.loading import apply_override_config, load_causal_lm, load_tokenizer
from verl_async.models.tiny import build_char_tokenizer
from verl_async.protocol import Response, RolloutSample, collate_groups, staleness
from verl_async.utils import device


def test_device_layer_cpu():
    spec = device.resolve("cpu")
    assert spec.torch_device == torch.device("cpu")
    assert device.dist_backend("cpu") == "gloo"
    assert device.dist_backend("cuda") == "nccl"
    assert device.dist_backend("npu") == "hccl"
    assert device.default_dtype("cpu") == torch.float32
    with pytest.raises(ValueError, match="trainer.device"):
        device.check_kind("tpu")


def test_device_layer_accepts_torch_device_strings():
    # Engine replicas hand engines str(torch.device(...)), e.g. "cuda:0"; the kind and index are parsed.
    assert device.resolve(str(torch.device("cpu", 0))).torch_device == torch.device("cpu")
    with pytest.raises(ValueError, match="index"):
        device.resolve("cuda:x")
    with pytest.raises(ValueError, match="trainer.device"):
        device.resolve("tpu:0")


def test_npu_missing_is_clear():
    if device.is_available("npu"):
        pytest.skip("torch_npu present")
    with pytest.raises(device.DeviceUnavailableError, match="torch_npu"):
        device.resolve("npu")


def test_tokenizer_roundtrip_and_chat_template():
    tok = build_char_tokenizer()
    text = "Natalia sold 48/2 = 24 clips. #### 72 ✓"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_a_bpe_tokenizer_that_asks_for_space_cleanup_decodes_without_it_and_without_a_warning(tmp_path, capfd):
    """Llama 3's and GGUF-converted tokenizer files set clean_up_tokenization_spaces=True; transformers 5.x ignores it
    for BPE with a warning per process, 4.x deletes the space in "a ." -> "a.". Loaded here, neither happens."""
    import json

    tok = build_char_tokenizer()  # byte-level BPE
    tok.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["clean_up_tokenization_spaces"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.clean_up_tokenization_spaces is False
    ids = loaded("2 + 3 = 5 .", add_special_tokens=False)["input_ids"]
    capfd.readouterr()
    assert loaded.batch_decode([ids], skip_special_tokens=True) == ["2 + 3 = 5 ."]
    out, err = capfd.readouterr()
    assert "clean_up_tokenization_spaces" not in out + err


def test_tiny_model_loads_with_override(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir, override_config={"model_config": {"max_position_embeddings": 777}})
    assert model.config.max_position_embeddings == 777
    assert model.config.vocab_size >= len(tok)
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.logits.shape == (1, 3, model.config.vocab_size)


def test_override_unknown_attribute_names_it(tiny_model_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="no_such_thing"):
        apply_override_config(cfg, {"no_such_thing": 1})


def test_missing_model_path_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="actor_rollout_ref.model.path"):
        load_tokenizer(str(tmp_path / "nope"))


def _resp(tokens, version, reward=0.0, reason="stop"):
    return Response(tokens, [-0.5] * len(tokens), [version] * len(tokens), reason, reward=reward)


def test_collate_groups_layout():
    g0 = RolloutSample("a", [5, 6], [_resp([1, 2, 3], 0, 1.0), _resp([4], 1, 0.0)])
    g1 = RolloutSample("b", [7], [_resp([8, 9], 2, 0.5), _resp([], 2, 0.0, "length")])
    td = collate_groups([g0, g1], pad_token_id=0)
    assert td.batch_size == torch.Size([4])
    assert td["prompts"].tolist() == [[5, 6], [5, 6], [0, 7], [0, 7]]
    assert td["responses"].tolist() == [[1, 2, 3], [4, 0, 0], [8, 9, 0], [0, 0, 0]]
    assert td["response_mask"].sum(1).tolist() == [3, 1, 2, 0]
    assert td["attention_mask"][2].tolist() == [0, 1, 1, 1, 0]
    assert td["position_ids"][2].tolist() == [0, 0, 1, 2, 2]
    assert td["group_index"].tolist() == [0, 0, 1, 1]
    assert td["token_versions"][1].tolist() == [1, -1, -1]
    assert td["scores"].tolist() == [1.0, 0.0, 0.5, 0.0]
    assert g0.min_version == 0 and g0.max_version == 1
    assert staleness([g0, g1], trainer_version=3) == [3, 1]


def test_group_atomicity_check():
    g = RolloutSample("a", [1], [_resp([1], 0)])
    with pytest.raises(ValueError, match="rollout.n=2"):
        g.validate(2)
    g.validate(1)
    g2 = RolloutSample.from_dict(g.to_dict())
    assert g2 == g


def test_response_lengths_must_agree():
    with pytest.raises(ValueError, match="same length"):
        Response([1, 2], [0.0], [0, 0], "stop")
