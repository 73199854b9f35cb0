"""LoRA in the FSDP2 trainer (verl_async/trainer/lora.py): adapters train alone, the weights leave merged.

Fast: `merged_weights` equals peft's own merge (`merge_and_unload`) on the tiny model with random
adapters, and `merged_shapes` names the same tensors in the same order (the collective sync plans
from it). Slow: a 2-rank FSDP2 group with lora_rank=8 trains on CPU; only the adapters have optimizer
state; the unadapted weights do not move; the reference log-probs are the base model's; the HF export,
the model merger's output and the saved adapter (through peft) all equal the weights the sync sends.
"""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import compose_config, make_batch, with_advantages

from verl_async.trainer.lora import LoraSettings, apply_lora, lora_scalings, merged_shapes, merged_weights

pytest.importorskip("peft")


def _tiny(model_dir: str):
    from verl_async.models.loading import load_causal_lm

    return load_causal_lm(model_dir, dtype=torch.float32, attn_implementation="eager")


def test_merged_weights_equal_peft_merge_and_unload(tiny_model_dir):
    settings = LoraSettings(rank=4, alpha=8.0, target_modules="all-linear", exclude_modules=None)
    model = apply_lora(_tiny(tiny_model_dir), settings)
    torch.manual_seed(0)
    with torch.no_grad():  # peft starts B at 0 (merging would change nothing): give the adapters values
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0.0, 0.05)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    scalings = lora_scalings(model)
    assert scalings and set(scalings.values()) == {2.0}  # alpha / r
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    ours = list(merged_weights(named, scalings))
    assert [(n, tuple(t.shape)) for n, t in ours] == merged_shapes([(n, tuple(t.shape)) for n, t in named])
    reference = dict(model.merge_and_unload().named_parameters())
    assert [n for n, _ in ours] == list(reference)  # HF names, named_parameters order
    for name, tensor in ours:
        torch.testing.assert_close(tensor, reference[name], msg=lambda m: f"{name}: {m}")
    # one scaling for all (the model merger's, from the checkpoint's lora meta) gives the same
    same = dict(merged_weights(named, 2.0))
    assert all(torch.equal(same[n], t) for n, t in ours)


def test_a_layer_missing_an_adapter_is_an_error():
    with pytest.raises(ValueError, match="without their base weight or both adapters"):
        list(merged_weights([("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight", torch.zeros(2, 2)),
                             ("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight", torch.zeros(1, 2))],
                            1.0))


@pytest.mark.slow
def test_lora_group_trains_adapters_and_sends_merged_weights(ray_session, tiny_model_dir, tmp_path):
    from peft import PeftModel

    from verl_async.model_merger.merge import merge
    from verl_async.sync.object_store import full_weights
    from verl_async.trainer import FSDPWorkerGroup

    a = "actor_rollout_ref.actor"
    cfg = compose_config(tiny_model_dir, "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.n=2",
                         f"{a}.ppo_mini_batch_size=2", "actor_rollout_ref.model.lora_rank=8",
                         "actor_rollout_ref.model.lora_alpha=16", f"{a}.use_kl_loss=true", f"{a}.kl_loss_coef=0.1",
                         f"{a}.optim.lr=0.05", f"{a}.ppo_max_token_len_per_gpu=24", "trainer.worker_timeout_s=180",
                         f"{a}.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    group = FSDPWorkerGroup(cfg, name="lora")
    try:
        info = group.init()
        assert 0 < info[0]["trainable_params"] < info[0]["params"] / 4
        batch = with_advantages(make_batch(groups=4, n=2, seed=11), seed=3)
        before = dict(full_weights(group, bucket_bytes=1 << 20))
        base_lp = group.compute_log_prob(batch)
        batch["old_log_probs"] = batch["rollout_log_probs"]
        batch["ref_log_prob"] = group.compute_ref_log_prob(batch)
        torch.testing.assert_close(batch["ref_log_prob"], base_lp)  # B = 0 at the start: the base model
        m = group.update(batch)
        assert m["actor/optimizer_steps"] == 2.0 and m["actor/grad_norm"] > 0
        after = dict(full_weights(group, bucket_bytes=1 << 20))
        assert list(after) == list(before) and "model.layers.0.self_attn.q_proj.weight" in after  # HF names
        moved = {k for k in after if not torch.equal(after[k], before[k])}
        assert moved and all(k.endswith("proj.weight") for k in moved)  # adapted linear layers only
        assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
        # the reference is the base model: unchanged by training
        torch.testing.assert_close(group.compute_ref_log_prob(batch), batch["ref_log_prob"])
        assert not torch.allclose(group.compute_log_prob(batch), base_lp)
        # checkpoint: the HF folder (written at save time), the merger's and peft's own merge of the saved adapter
        ckpt = group.save_checkpoint(str(tmp_path / "ckpts"))
        from transformers import AutoModelForCausalLM

        exported = dict(AutoModelForCausalLM.from_pretrained(f"{ckpt}/huggingface").named_parameters())
        merged_dir = merge("fsdp", ckpt, str(tmp_path / "merged"))
        merged = dict(AutoModelForCausalLM.from_pretrained(merged_dir).named_parameters())
        via_peft = dict(PeftModel.from_pretrained(_tiny(tiny_model_dir), f"{ckpt}/huggingface/lora_adapter")
                        .merge_and_unload().named_parameters())
        for name, tensor in after.items():
            for where, other in (("export", exported), ("merger", merged), ("peft", via_peft)):
                torch.testing.assert_close(other[name].float(), tensor.float(), rtol=1e-5, atol=1e-6,
                                           msg=lambda msg: f"{where} {name}: {msg}")
        # resume: a new group from the checkpoint has the same weights
        group.shutdown()
        group = FSDPWorkerGroup(cfg, name="lora_resumed")
        group.init()
        group.load(ckpt)
        resumed = dict(full_weights(group, bucket_bytes=1 << 20))
        assert all(torch.equal(resumed[k], after[k]) for k in after)
    finally:
        group.shutdown()


@pytest.mark.slow
def test_lora_pipeline_engine_samples_with_the_merged_weights(ray_session, tiny_model_dir, tmp_path):
    """The whole run (native engine, object-store sync) with LoRA, on-policy, old log-probs recomputed: the
    policy moves away from the base model (KL of the old log-probs to the reference, the adapters off), and
    the engine's log-probs stay equal to the trainer's at every step: the merged weights reached it."""
    import json

    from verl_async.config import compose, validate
    from verl_async.data import builtin, write_rows
    from verl_async.pipeline import run

    rows = builtin.generate_rows("train", 8, seed=3)
    write_rows(rows, str(tmp_path / "train.parquet"))
    scorer = tmp_path / "score.py"  # the random tiny model solves nothing: a reward that differs within a group
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
                      "    return float(len(solution_str) % 3)\n")
    a = "actor_rollout_ref.actor"
    cfg = validate(compose(overrides=[
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={tmp_path / 'train.parquet'}",
        "data.val_files=null", "data.max_prompt_length=64", "data.max_response_length=12",
        "actor_rollout_ref.rollout.n=2", f"{a}.ppo_mini_batch_size=2", f"{a}.optim.lr=0.05",
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16", f"{a}.use_kl_loss=true",
        "rollout.total_rollout_steps=8", "async_training.staleness_threshold=0",
        "async_training.trigger_parameter_sync_step=1", "async_training.use_rollout_log_probs=false",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[file]",
        f"custom_reward_function.path={scorer}", "actor_rollout_ref.rollout.temperature=1.5",
        f"trainer.default_local_dir={tmp_path / 'run'}", "ray_init.num_cpus=4"]))
    summary = run(cfg)
    assert summary["trainer/steps"] == 4
    lines = [json.loads(x)["data"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "mismatch/train_rollout_logprob_abs_diff_max" in m]
    assert len(steps) == 4
    assert all(m["mismatch/train_rollout_logprob_abs_diff_max"] < 1e-3 for m in steps), steps
    assert steps[0]["actor/ref_kl_of_old"] == pytest.approx(0.0, abs=1e-6)  # B = 0: the base model
    assert abs(steps[-1]["actor/ref_kl_of_old"]) > 1e-3  # the policy the engine samples has moved
