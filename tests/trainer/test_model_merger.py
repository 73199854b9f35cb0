"""verl_async.model_merger: checkpoint folders -> HF folders, offline (no Ray, no process group).

The checkpoints here are written by hand in the trainers' layouts (DCP shards; Megatron per-rank
files split by trainer/megatron/convert.py), so each test knows the exact weights to expect.
The trainer-written checkpoints (a few real steps, then the command line) are in
test_model_merger_trainers.py.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from verl_async.model_merger import MergeError, merge
from verl_async.model_merger.__main__ import main
from verl_async.model_merger.merge import HFSource
from verl_async.trainer.hf_export import save_config_and_tokenizer
from verl_async.trainer.megatron.convert import model_spec, param_maps, to_mcore_shard


def hf_model(model_dir: str, *, tie: bool = True, seed: int = 0):
    """The tiny model with random (trained-looking) weights; `tie=False` unties the LM head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = tie
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def checkpoint_folder(tmp_path, model_dir: str, model, meta: dict) -> str:
    """actor/ with meta.json and huggingface/ (config + tokenizer) as the trainers write them."""
    local = tmp_path / "global_step_3" / "actor"
    local.mkdir(parents=True)
    save_config_and_tokenizer(str(local / "huggingface"), model.config, HFSource(model_dir))
    (local / "meta.json").write_text(json.dumps({"global_step": 3, "world_size": 2, "model_path": model_dir, **meta}))
    return str(local)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


IDS = torch.tensor([[5, 17, 99, 3, 200, 42, 7]])


def fsdp_checkpoint(tmp_path, model_dir, model) -> str:
    import torch.distributed.checkpoint as dcp

    local = checkpoint_folder(tmp_path, model_dir, model, {"backend": "fsdp", "hf_dtype": "float32"})
    optimizer = {"state": {name: {"exp_avg": torch.zeros_like(p)} for name, p in model.named_parameters()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict(), "optimizer": optimizer}, checkpoint_id=os.path.join(local, "dcp"),
                 no_dist=True)
    return local


def test_fsdp_shards_merge_to_the_same_model(tmp_path, tiny_model_dir):
    model = hf_model(tiny_model_dir)
    local = fsdp_checkpoint(tmp_path, tiny_model_dir, model)
    out = merge("fsdp", local, str(tmp_path / "hf"))
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    assert "chat_template.jinja" in files or "chat_template" in open(os.path.join(out, "tokenizer_config.json")).read()
    merged = load(out)
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in merged.named_parameters())
    assert torch.equal(logits(merged, IDS), logits(model, IDS))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_dtype_is_the_training_dtype_or_the_one_asked_for(tmp_path, tiny_model_dir):
    from safetensors import safe_open

    model = hf_model(tiny_model_dir)
    local = fsdp_checkpoint(tmp_path, tiny_model_dir, model)
    meta = json.loads(open(os.path.join(local, "meta.json")).read())
    meta["hf_dtype"] = "bfloat16"  # what a GPU run records (the FSDP master weights are fp32)
    open(os.path.join(local, "meta.json"), "w").write(json.dumps(meta))
    for dtype, expected in ((None, torch.bfloat16), ("float32", torch.float32)):
        out = merge("fsdp", local, str(tmp_path / f"hf_{dtype}"), dtype=dtype)
        with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {expected}
        config = json.loads(open(os.path.join(out, "config.json")).read())
        assert config.get("dtype", config.get("torch_dtype")) == str(expected).removeprefix("torch.")


def stage_params(spec, pp: int):
    """(stage, local name, param map) of every Megatron parameter, as megatron-core places them: the embedding
    on the first stage, an even split of the layers, the final norm and the head on the last (a tied model's
    last stage keeps a copy of the embedding as its output layer)."""
    per_stage, maps = spec.num_layers // pp, param_maps(spec)
    for pm in maps:
        if pm.mcore.startswith("decoder.layers."):
            layer = int(pm.mcore.split(".")[2])
            stage = layer // per_stage
            yield stage, pm.mcore.replace(f"layers.{layer}.", f"layers.{layer - stage * per_stage}.", 1), pm
        else:
            yield (0 if pm.mcore.startswith("embedding") else pp - 1), pm.mcore, pm
    if spec.tie_word_embeddings:
        yield pp - 1, "output_layer.weight", maps[0]


def megatron_checkpoint(tmp_path, model_dir, model, tp: int, pp: int, names_for: tuple[int, ...]) -> str:
    """Per-rank files as MegatronWorker.save writes them; stages not in `names_for` lack names_pp*.json
    (checkpoints written before it existed)."""
    spec = model_spec(model.config)
    hf = dict(model.state_dict())
    local = checkpoint_folder(tmp_path, model_dir, model, {
        "backend": "megatron", "hf_dtype": "float32",
        "layout": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "data_parallel_size": 1,
                   "use_distributed_optimizer": True}})
    folder = os.path.join(local, "megatron")
    os.makedirs(folder)
    placed = list(stage_params(spec, pp))
    for stage in range(pp):
        mine = [(name, pm) for s, name, pm in placed if s == stage]
        for t in range(tp):
            shard = {name: to_mcore_shard(spec, pm, [hf[n] for n in pm.hf], t, tp).clone() for name, pm in mine}
            shard["decoder.layers.0.self_attention.core_attention._extra_state"] = None
            torch.save(shard, os.path.join(folder, f"model_tp{t}_pp{stage}.pt"))
        if stage in names_for:
            names = {name: ("output_layer.weight" if name == "output_layer.weight" else pm.mcore) for name, pm in mine}
            with open(os.path.join(folder, f"names_pp{stage}.json"), "w") as f:
                json.dump(names, f)
    return local


@pytest.mark.parametrize("tie", [True, False])
def test_megatron_shards_merge_to_the_same_model(tmp_path, tiny_model_dir, tie):
    model = hf_model(tiny_model_dir, tie=tie)
    local = megatron_checkpoint(tmp_path, tiny_model_dir, model, tp=2, pp=2, names_for=(0,))
    merged = load(merge("megatron", local, str(tmp_path / "hf")))
    expected = dict(model.named_parameters())
    got = dict(merged.named_parameters())
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in got)
    assert torch.equal(logits(merged, IDS), logits(model, IDS))


def test_errors_say_what_to_pass(tmp_path, tiny_model_dir, capsys):
    model = hf_model(tiny_model_dir)
    local = fsdp_checkpoint(tmp_path, tiny_model_dir, model)
    with pytest.raises(MergeError, match=r"written by the fsdp trainer: use --backend fsdp"):
        merge("megatron", local, str(tmp_path / "out"))
    with pytest.raises(MergeError, match=r"not a complete checkpoint \(no meta\.json"):
        merge("fsdp", os.path.dirname(local), str(tmp_path / "out"))
    os.rename(os.path.join(local, "huggingface"), os.path.join(tmp_path, "moved"))
    meta = json.loads(open(os.path.join(local, "meta.json")).read())
    open(os.path.join(local, "meta.json"), "w").write(json.dumps({**meta, "model_path": "/no/such/model"}))
    with pytest.raises(MergeError, match=r"no huggingface/config\.json .*pass --hf_model_path"):
        merge("fsdp", local, str(tmp_path / "out"))
    assert main(["merge", "--backend", "fsdp", "--local_dir", local, "--target_dir", str(tmp_path / "out"),
                 "--hf_model_path", str(tmp_path / "moved")]) == 0
    assert torch.equal(logits(load(str(tmp_path / "out")), IDS), logits(model, IDS))
    assert main(["merge", "--backend", "fsdp", "--local_dir", str(tmp_path), "--target_dir", "x"]) == 2
    assert "model_merger error: --local_dir" in capsys.readouterr().err
    mlocal = megatron_checkpoint(tmp_path / "m", tiny_model_dir, model, tp=2, pp=1, names_for=(0,))
    os.remove(os.path.join(mlocal, "megatron", "model_tp1_pp0.pt"))
    with pytest.raises(MergeError, match=r"missing Megatron model shard .*model_tp1_pp0\.pt"):
        merge("megatron", mlocal, str(tmp_path / "out2"))
