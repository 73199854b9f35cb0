"""Megatron-core worker groups on CPU (gloo): TP=1, TP=2, PP=2, DP=2 against each other and against HF.

megatron-core runs on CPU through `device_shim.cpu_mode()` (its CUDA device queries
redirected; every op still runs the CPU kernel). Four groups serve the module:

* tp1: 1 rank, the reference fusion/optimizer overrides of the Ascend launch script
  (turned off here, with notes);
* tp2: 2 ranks, tensor parallel; pp2: 2 ranks, pipeline parallel (1F1B schedule);
* dp2: 2 data-parallel ranks, distributed optimizer, param/grad/optimizer offload on;
* fsdp: the FSDP2 group (1 rank) on the same config keys: the other backend.

Every test first restores the group's initial checkpoint (which also tests load).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from trainer_helpers import compose_config, make_batch, with_advantages
from verl_async.sync.object_store import full_weights

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

LR = 0.05
A = "actor_rollout_ref.actor"
REFERENCE_OVERRIDES = [f"+{A}.megatron.override_transformer_config.{k}=True" for k in (
    "apply_rope_fusion", "masked_softmax_fusion", "gradient_accumulation_fusion", "deallocate_pipeline_outputs",
    "persist_layer_norm", "use_flash_attn")] + [
    f"+{A}.optim.override_optimizer_config.optimizer_offload_fraction=0",
    f"+{A}.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=True",
    f"+{A}.optim.override_optimizer_config.use_precision_aware_optimizer=True",
    f"+{A}.optim.override_optimizer_config.optimizer_cpu_offload=True"]
LAYOUTS = {
    "tp1": (1, [*REFERENCE_OVERRIDES]),
    "tp2": (2, [f"{A}.megatron.tensor_model_parallel_size=2"]),
    "pp2": (2, [f"{A}.megatron.pipeline_model_parallel_size=2", f"{A}.megatron.use_distributed_optimizer=false"]),
    "dp2": (2, [f"{A}.megatron.param_offload=true", f"{A}.megatron.grad_offload=true",
                f"{A}.megatron.optimizer_offload=true", "actor_rollout_ref.ref.megatron.param_offload=true"]),
}
DEFAULTS = {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 24, "ppo_mini_batch_size": 2, "ppo_epochs": 1,
            "log_prob_use_dynamic_bsz": True, "log_prob_max_token_len_per_gpu": 24}


def _config(model_dir: str, world: int, extra: list[str], config_name: str = "fully_async_ppo_megatron_trainer"):
    return compose_config(
        model_dir, f"trainer.n_gpus_per_node={world}", "actor_rollout_ref.rollout.n=2", f"{A}.ppo_mini_batch_size=2",
        f"{A}.use_kl_loss=true", f"{A}.kl_loss_coef=0.1", f"{A}.entropy_coeff=0.01", f"{A}.grad_clip=100.0",
        f"{A}.ppo_max_token_len_per_gpu=24", f"{A}.optim.lr={LR}", f"{A}.optim.eps=1.0",
        f"{A}.optim.weight_decay=0.0", "trainer.worker_timeout_s=180", *extra, config_name=config_name)


MEGATRON_SCHEDULE = [f"{A}.optim.lr_decay_style=cosine", f"{A}.optim.lr_decay_steps=6"]


@pytest.fixture(scope="module")
def groups(ray_session, tiny_model_dir, tmp_path_factory):
    from verl_async.trainer import FSDPWorkerGroup
    from verl_async.trainer.megatron.worker_group import MegatronWorkerGroup

    built = {name: MegatronWorkerGroup(_config(tiny_model_dir, world, [*MEGATRON_SCHEDULE, *extra]),
                                       name=f"test_megatron_{name}")
             for name, (world, extra) in LAYOUTS.items()}
    built["fsdp"] = FSDPWorkerGroup(_config(tiny_model_dir, 1, [], "fully_async_ppo_trainer"), name="test_fsdp_ref")
    try:
        with ThreadPoolExecutor(len(built)) as pool:  # actor start-up dominates: start all at once
            infos = dict(zip(built, pool.map(lambda g: g.init(), built.values())))
        assert [(i["dp_rank"], i["tp_rank"], i["pp_rank"]) for i in infos["tp2"]] == [(0, 0, 0), (0, 1, 0)]
        assert [(i["dp_rank"], i["pp_rank"]) for i in infos["pp2"]] == [(0, 0), (0, 1)]
        assert [i["dp_rank"] for i in infos["dp2"]] == [0, 1] and built["dp2"].dp_size == 2
        for name, group in megatron(built).items():
            group.initial = group.save(str(tmp_path_factory.mktemp(f"init_{name}")))
        # The FSDP group is used once, from its fresh state (never saved): the Megatron groups, restored from
        # checkpoints taken before their first step, must take the first step of a fresh Adam (step counter 0).
        built["fsdp"].set_options(**DEFAULTS)
        yield built
    finally:
        for group in built.values():
            group.shutdown()


def reset(group, **options):
    group.load(group.initial)
    group.set_options(**{**DEFAULTS, **options})
    return group


def weights(group) -> dict[str, torch.Tensor]:
    return dict(full_weights(group, bucket_bytes=1 << 20))


def hf_log_probs(model_dir: str, batch, *, entropy: bool = False):
    from verl_async.algos import logprobs_and_entropy
    from verl_async.models.loading import load_causal_lm
    from verl_async.trainer.batching import build_model_inputs

    model = load_causal_lm(model_dir, dtype=torch.float32).eval()
    inputs = build_model_inputs(batch, list(range(batch.batch_size[0])), packed=False, pad_token_id=0)
    with torch.no_grad():
        logits = model(**inputs.model_kwargs()).logits
    logp, ent = logprobs_and_entropy(logits, inputs.labels, 1.0)
    return (inputs.scatter(logp), inputs.scatter(ent)) if entropy else inputs.scatter(logp)


@pytest.fixture(scope="module")
def batch(groups, tiny_model_dir):
    b = with_advantages(make_batch(groups=4, n=2, seed=11, empty_response_rows=1), seed=3)
    logp = hf_log_probs(tiny_model_dir, b)
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(5))
    b["old_log_probs"] = (logp + 0.05 * noise) * b["response_mask"]
    b["ref_log_prob"] = logp
    return b


def megatron(groups) -> dict:
    return {name: g for name, g in groups.items() if name != "fsdp"}


def test_conversion_roundtrip_is_bit_exact(groups, tiny_model_dir):
    """HF safetensors -> Megatron TP/PP shards -> gathered HF tensors: identical bits, each HF name once."""
    from safetensors.torch import load_file

    from verl_async.models.loading import load_causal_lm

    stored = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    names = sorted(n for n, _ in load_causal_lm(tiny_model_dir).named_parameters())
    for name, group in megatron(groups).items():
        synced = list(full_weights(reset(group), bucket_bytes=1 << 14))
        assert sorted(n for n, _ in synced) == names, name
        for n, t in synced:
            assert t.dtype == torch.float32 and torch.equal(t, stored[n]), f"{name}: {n}"


def test_log_probs_and_entropy_match_hf(groups, batch, tiny_model_dir):
    ref_logp, ref_ent = hf_log_probs(tiny_model_dir, batch, entropy=True)
    mask = batch["response_mask"].bool()
    for name, group in megatron(groups).items():
        logp, ent = reset(group).compute_log_prob(batch, calculate_entropy=True)
        assert torch.allclose(logp, ref_logp, atol=1e-5), f"{name}: {(logp - ref_logp).abs().max()}"
        assert torch.allclose(ent, ref_ent, atol=1e-5), name
        assert bool((logp[~mask] == 0).all())
        assert torch.equal(group.compute_ref_log_prob(batch), logp), f"{name}: first step KL must be 0"


def test_one_update_agrees_across_layouts_and_with_fsdp(groups, batch):
    initial = weights(reset(groups["tp1"]))
    runs = {name: (reset(g).update(batch), weights(g)) for name, g in megatron(groups).items()}
    runs["fsdp"] = (groups["fsdp"].update(batch), weights(groups["fsdp"]))
    m1, w1 = runs["tp1"]
    assert m1["actor/optimizer_steps"] == 2.0 and m1["actor/lr"] == pytest.approx(LR)
    assert max(float((w1[k] - initial[k]).abs().max()) for k in w1) > 1e-3, "the update must move the weights"
    for name, (m, w) in runs.items():
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac"):
            assert m[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), f"{name}: {key}"
        assert m["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-4), name
        for k in w1:
            assert torch.allclose(w[k], w1[k], rtol=1e-4, atol=1e-5), \
                f"{name}: {k} differs by {float((w[k] - w1[k]).abs().max())}"


def test_reference_overrides_are_turned_off_with_notes_on_cpu(groups):
    notes = "\n".join(groups["tp1"].notes)
    for key in ("apply_rope_fusion", "masked_softmax_fusion", "gradient_accumulation_fusion", "use_flash_attn",
                "use_precision_aware_optimizer", "optimizer_cpu_offload"):
        assert f".{key}=True turned off" in notes, key
    assert "deallocate_pipeline_outputs" not in notes  # pure Python: kept


def test_save_load_continue_equals_uninterrupted(groups, tmp_path):
    from verl_async.trainer import latest_checkpoint

    batches = [with_advantages(make_batch(groups=4, n=2, seed=30 + i), seed=i) for i in range(3)]
    for b in batches:
        b["old_log_probs"] = b["ref_log_prob"] = b["rollout_log_probs"]
    for name in ("dp2", "pp2"):  # sharded optimizer + offload; pipeline stages
        g = reset(groups[name])
        g.update(batches[0])
        path = g.save_checkpoint(str(tmp_path / name), extra={"cursor": 7})
        assert path == latest_checkpoint(str(tmp_path / name))
        straight = [g.update(b) for b in batches[1:]]
        w_straight = weights(g)
        assert g.load(path) == {"cursor": 7} and g.global_step == 1
        resumed = [g.update(b) for b in batches[1:]]
        for a, b in zip(straight, resumed):
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr"):
                assert a[key] == b[key], f"{name}: {key}"
        w_resumed = weights(g)
        assert all(torch.equal(w_straight[k], w_resumed[k]) for k in w_straight), name
    lrs = [m["actor/lr"] for m in straight]
    assert lrs[0] > lrs[1]  # cosine decay continues from the restored schedule


def test_checkpoint_of_another_layout_is_refused(groups):
    with pytest.raises(ValueError, match=r"layout .*tensor_model_parallel_size': 1.*Resume with the same layout"):
        groups["tp2"].load(groups["tp1"].initial)
    reset(groups["tp2"])  # still usable


def test_export_hf_loads_with_transformers(groups, batch, tmp_path):
    from transformers import AutoModelForCausalLM

    g = reset(groups["tp2"])
    g.update(batch)
    path = g.export_hf(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = dict(model.named_parameters())
    sync = weights(g)
    assert set(sync) == set(params) and all(torch.equal(sync[k], params[k].detach()) for k in sync)
    assert torch.allclose(hf_log_probs(path, batch), g.compute_log_prob(batch), atol=1e-5)


def test_bad_overrides_fail_in_the_driver(tiny_model_dir):
    from verl_async.trainer.megatron.worker_group import MegatronWorkerGroup

    bad = _config(tiny_model_dir, 1, [f"+{A}.megatron.override_transformer_config.apply_rope_fuson=True"])
    with pytest.raises(ValueError, match=r"override_transformer_config\.apply_rope_fuson: unknown key"):
        MegatronWorkerGroup(bad)
    owned = _config(tiny_model_dir, 1, [f"+{A}.megatron.override_transformer_config.hidden_size=8"])
    with pytest.raises(ValueError, match=r"hidden_size: set from the HF config"):
        MegatronWorkerGroup(owned)


def test_non_finite_loss_skips_the_step_on_every_stage(groups, batch):
    g = reset(groups["pp2"])  # the loss lives on the last stage; rank 0 (first stage) must skip too
    before = weights(g)
    huge = batch.clone()
    huge["advantages"] = batch["response_mask"] * 3e38
    m = g.update(huge)
    assert m["actor/skipped_steps"] == 2.0 and m["actor/optimizer_steps"] == 0.0
    assert m["actor/total_skipped_steps"] >= 2.0
    after = weights(g)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert g.update(batch)["actor/optimizer_steps"] == 2.0


def test_collective_weight_sync_from_tp_pp_and_dp_ranks_is_bit_exact(groups, tmp_path_factory):
    """The Megatron trainer's collective sender (gloo here; nccl on GPUs): the buckets are planned on rank 0 from the
    shapes gathered at start-up, every rank drives the TP gathers / PP sends, and each of 2 engine replicas (which
    start from OTHER random weights) loads exactly what the object store's full weights hold."""
    import ray

    from verl_async.models.tiny import build_tiny_model_dir
    from verl_async.rollout.replica import SyncTarget
    from verl_async.sync import build_sync
    from verl_async.sync.buckets import tensor_checksum

    engine_dir = build_tiny_model_dir(str(tmp_path_factory.mktemp("megatron_engine")), seed=321)
    rollout_cfg = {"name": "native", "max_num_seqs": 2, "max_model_len": 64, "seed": 0}
    side = ray.remote(SyncTarget).options(num_cpus=0.1, max_concurrency=100).remote(2, rollout_cfg, engine_dir, "cpu")
    try:
        ray.get(side.weight_sync.remote("collective", "ranks"), timeout=120)
        for version, name in enumerate(("tp2", "pp2", "dp2"), start=1):
            group = reset(groups[name])
            reference = {n: tensor_checksum(t) for n, t in weights(group).items()}
            shapes = ray.get(group.workers[0].full_param_shapes.remote(), timeout=60)
            assert [n for n, _ in shapes] == list(reference), name  # the plan's order is the sender's
            sync = build_sync("gloo", group, side, bucket_bytes=16 << 10, timeout_s=60, verify=True)
            try:
                metrics = sync.push(version)
            finally:
                sync.close()
            assert metrics["sync/buckets"] > 1 and metrics["sync/verified_tensors"] == len(reference), name
            assert ray.get(side.state.remote(), timeout=30) == (version, version), name
            for who, got in sync.last["receivers"].items():
                assert got["loaded_checksums"] == reference, (name, who)
    finally:
        ray.kill(side)
