"""FSDP2 worker group on CPU: 2 gloo ranks against 1, on-policy first step, resume, export, bad input.

One 2-rank and one 1-rank group serve the whole module (starting them is the slow
part); every test first restores the initial checkpoint and its runtime options.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch
from trainer_helpers import compose_config, make_batch, with_advantages

from verl_async.trainer import FSDPWorkerGroup, WorkerGroupError, latest_checkpoint
from verl_async.trainer.lr_schedule import lr_factor
from verl_async.sync.object_store import bucket_refs, full_weights

pytestmark = pytest.mark.slow

LOSS_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LAYOUTS = (
    {"use_dynamic_bsz": False, "use_remove_padding": False, "ppo_micro_batch_size_per_gpu": 3},
    {"use_dynamic_bsz": True, "use_remove_padding": True, "ppo_max_token_len_per_gpu": 24},
    {"use_dynamic_bsz": False, "use_remove_padding": True, "ppo_micro_batch_size_per_gpu": 1},
)
DEFAULTS = {
    "loss_agg_mode": "token-mean", "use_dynamic_bsz": True, "use_remove_padding": True,
    "ppo_max_token_len_per_gpu": 24, "ppo_micro_batch_size_per_gpu": 2, "ppo_mini_batch_size": 2, "ppo_epochs": 1,
    "shuffle": False, "log_prob_use_dynamic_bsz": True, "log_prob_max_token_len_per_gpu": 24,
    "rollout_correction": {"enable": False, "mode": "truncate", "rs": False, "upper": 2.0},
    "loss_mode": "vanilla",
}
TOTAL_STEPS = 6
LR = 0.05


def _overrides(world: int) -> list[str]:
    a = "actor_rollout_ref.actor"
    return [
        f"trainer.n_gpus_per_node={world}", "actor_rollout_ref.rollout.n=2", f"{a}.ppo_mini_batch_size=2",
        f"{a}.use_kl_loss=true", f"{a}.kl_loss_coef=0.1", f"{a}.entropy_coeff=0.01", f"{a}.grad_clip=100.0",
        f"{a}.ppo_max_token_len_per_gpu=24",
        # eps=1 makes Adam's first step ~ lr * grad (not lr * sign(grad)): weights then compare gradients.
        f"{a}.optim.lr={LR}", f"{a}.optim.eps=1.0", f"{a}.optim.lr_scheduler_type=cosine",
        f"{a}.optim.total_training_steps={TOTAL_STEPS}", f"{a}.optim.min_lr_ratio=0.1",
        "trainer.worker_timeout_s=120",
    ]


@pytest.fixture(scope="module")
def groups(ray_session, tiny_model_dir, tmp_path_factory):
    built = {world: FSDPWorkerGroup(compose_config(tiny_model_dir, *_overrides(world)), name=f"test_fsdp{world}")
             for world in (2, 1)}
    try:
        with ThreadPoolExecutor(len(built)) as pool:  # start both groups at once: actor start-up dominates
            infos = dict(zip(built, pool.map(lambda g: g.init(), built.values())))
        for world, group in built.items():
            assert [i["rank"] for i in infos[world]] == list(range(world))
            group.initial = group.save(str(tmp_path_factory.mktemp(f"init{world}")))
        yield built
    finally:
        for group in built.values():
            group.shutdown()


def reset(group: FSDPWorkerGroup, **options):
    group.load(group.initial)
    group.set_options(**{**DEFAULTS, **options})
    return group


def weights(group: FSDPWorkerGroup) -> dict[str, torch.Tensor]:
    return dict(full_weights(group, bucket_bytes=1 << 20))


@pytest.fixture(scope="module")
def batch(groups):
    """Policy-consistent batch: old log-probs near the model's, reference log-probs, advantages."""
    b = with_advantages(make_batch(groups=4, n=2, seed=11, empty_response_rows=1), seed=3)
    g = reset(groups[1])
    logp = g.compute_log_prob(b)
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(5))
    b["old_log_probs"] = (logp + 0.05 * noise) * b["response_mask"]
    b["ref_log_prob"] = g.compute_ref_log_prob(b)
    b["rollout_log_probs"] = b["old_log_probs"] + 0.02 * noise * b["response_mask"]
    return b


def test_first_step_is_on_policy(groups):
    g = reset(groups[2], ppo_mini_batch_size=4, ppo_epochs=1)
    b = with_advantages(make_batch(groups=4, n=2, seed=21), seed=1)
    logp, entropy = g.compute_log_prob(b, calculate_entropy=True)
    ref = g.compute_ref_log_prob(b)
    mask = b["response_mask"].bool()
    assert torch.equal(logp, ref), "log_probs == ref_log_probs on the first step (KL = 0)"
    assert bool((logp[mask] < 0).all()) and bool((logp[~mask] == 0).all())
    assert bool((entropy[mask] > 0).all())
    b["old_log_probs"], b["ref_log_prob"] = logp, ref
    m = g.update(b)
    assert m["actor/optimizer_steps"] == 1.0
    assert abs(m["actor/ppo_kl"]) < 1e-6 and m["actor/pg_clipfrac"] == 0.0
    assert abs(m["actor/kl_loss"]) < 1e-8
    assert m["actor/grad_norm"] > 0 and m["actor/lr"] == pytest.approx(LR)


def test_two_ranks_equal_one_rank_for_every_loss_mode_and_layout(groups, batch):
    initial = weights(reset(groups[1]))
    for mode in LOSS_MODES:
        for layout in LAYOUTS:
            runs = {}
            for world, g in groups.items():
                reset(g, loss_agg_mode=mode, **layout)
                runs[world] = (g.update(batch), weights(g))
            (m2, w2), (m1, w1) = runs[2], runs[1]
            where = f"{mode} {layout}"
            assert m1["actor/optimizer_steps"] == 2.0, where
            for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac"):
                assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), f"{where}: {key}"
            assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-4), where
            moved = max(float((w1[k] - initial[k]).abs().max()) for k in w1)
            assert moved > 1e-4, f"{where}: the update must move the weights"
            for k in w1:
                assert torch.allclose(w2[k], w1[k], rtol=1e-5, atol=1e-6), \
                    f"{where}: {k} differs by {float((w2[k] - w1[k]).abs().max())}"


def test_two_ranks_equal_one_rank_for_every_policy_loss(groups, batch):
    """verl 0.9's policy losses train through the worker group: 2 ranks == 1 rank (the shares add up), the
    weights move, and the loss differs from vanilla's. clip_cov and kl_cov pick their tokens inside each
    micro-batch (as verl does), so for them each world size only has to train."""
    from verl_async.algos.policy_losses import POLICY_LOSSES

    params = {"dro_beta": 0.1, "clip_cov_ratio": 0.2, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0, "kl_cov_ratio": 0.2,
              "ppo_kl_coef": 1.0, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.99_1.01"}
    layout = {"use_dynamic_bsz": True, "use_remove_padding": True, "ppo_max_token_len_per_gpu": 24,
              "loss_agg_mode": "seq-mean-token-mean"}
    vanilla = reset(groups[1], **layout).update(batch)["actor/pg_loss"]
    for mode in POLICY_LOSSES:
        runs = {}
        for world, g in groups.items():
            reset(g, loss_mode=mode, policy_loss=params, **layout)
            torch.manual_seed(0)
            runs[world] = (g.update(batch), weights(g))
        (m2, w2), (m1, w1) = runs[2], runs[1]
        assert m1["actor/optimizer_steps"] == m2["actor/optimizer_steps"] == 2.0, mode
        if mode in ("clip_cov", "kl_cov"):
            continue
        if mode != "vanilla":
            assert abs(m1["actor/pg_loss"] - vanilla) > 1e-6, f"{mode} trains as vanilla"
        for key in ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), f"{mode}: {key}"
        for k in w1:
            assert torch.allclose(w2[k], w1[k], rtol=1e-5, atol=1e-6), f"{mode}: {k}"


def _accumulation_batch():
    """Mini-batches of 2 groups (ppo_mini_batch_size=2): 6 rows, then 3 (one rank has a row less)."""
    b = with_advantages(make_batch(groups=3, n=3, seed=12), seed=4)
    b["old_log_probs"] = b["rollout_log_probs"]
    b["ref_log_prob"] = (b["rollout_log_probs"] - 0.05) * b["response_mask"]
    return b


def _one_micro_batch_reference(one: FSDPWorkerGroup, b):
    """One rank, every mini-batch in one micro-batch: one backward per optimizer step, nothing to accumulate."""
    initial = weights(reset(one))
    m_ref = reset(one, use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu=8).update(b)
    w_ref = weights(one)
    assert m_ref["actor/optimizer_steps"] == 2.0
    assert max(float((w_ref[k] - initial[k]).abs().max()) for k in w_ref) > 1e-4
    return m_ref, w_ref


def _count_reduce_scatters(worker) -> None:
    """In a rank's process (Ray's `__ray_call__`): from now on each update counts the reduce-scatters it issues (the
    c10d ops FSDP2 calls, seen by a TorchDispatchMode around the whole update: forward, backward and its hooks)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ReduceScatters(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d" and "reduce_scatter" in func.__name__:
                self.count += 1
            return func(*args, **(kwargs or {}))

    update = type(worker)._update

    def counted(*args, **kwargs):
        with ReduceScatters() as seen:
            result = update(worker, *args, **kwargs)
        worker.reduce_scatters = seen.count
        return result

    worker._update = counted


def _reduce_scatters(group: FSDPWorkerGroup) -> list[int]:
    """Each rank's reduce-scatters in the last update (after `_count_reduce_scatters`)."""
    return ray.get([w.__ray_call__.remote(lambda worker: worker.reduce_scatters) for w in group.workers], timeout=60)


def test_gradients_reduce_once_per_mini_batch_and_equal_one_micro_batch(groups):
    """fsdp_config.grad_accum_no_sync: FSDP2 skips the reduce-scatter of all micro-batches but the last of a
    mini-batch. Same weights as reducing every micro-batch, and as one micro-batch on one rank holding the same
    rows (no accumulation at all: an independent reference), with a dummy micro-batch that is the LAST one on a
    rank and a mini-batch of a single micro-batch; the reduce-scatters drop from one per micro-batch to one per
    mini-batch."""
    from verl_async.trainer.batching import plan_update, sequence_lengths

    b = _accumulation_batch()
    layouts = {
        "3 micro / rank, then [row], [dummy]": {"use_dynamic_bsz": False, "ppo_micro_batch_size_per_gpu": 1},
        "by tokens": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 18},
        "2 micro, then 1 micro": {"use_dynamic_bsz": False, "ppo_micro_batch_size_per_gpu": 2},
    }
    p_len, r_len = sequence_lengths(b)
    weights_ = (p_len + r_len).tolist()
    micro_counts = {}
    for name, layout in layouts.items():
        plans = plan_update(b["group_index"], weights_, b["response_mask"], mini_groups=2, epochs=1, shuffle=False,
                            seed=0, dp=2, dynamic=layout["use_dynamic_bsz"],
                            micro_size=layout.get("ppo_micro_batch_size_per_gpu", 1),
                            max_tokens=layout.get("ppo_max_token_len_per_gpu", 24))
        micro_counts[name] = [len(p.micro[0]) for p in plans]
        assert all(len(p.micro[0]) == len(p.micro[1]) for p in plans)
        assert len(plans) == 2 and micro_counts[name][0] > 1, (name, [p.micro for p in plans])
        if name.startswith("3 micro"):
            assert plans[1].micro[0][-1] == [] or plans[1].micro[1][-1] == [], "the last micro-batch is a dummy"
        if name.startswith("2 micro"):
            assert micro_counts[name][1] == 1
    m_ref, w_ref = _one_micro_batch_reference(groups[1], b)
    # the ranks' processes cannot import this test module: its functions travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.get([w.__ray_call__.remote(_count_reduce_scatters) for w in groups[2].workers], timeout=60)
    try:
        _accumulate_every_layout(groups[2], b, layouts, micro_counts, m_ref, w_ref)
    finally:  # the module's other tests: the plain update again
        ray.get([w.__ray_call__.remote(lambda worker: bool(worker.__dict__.pop("_update", None)))
                 for w in groups[2].workers], timeout=60)


def _accumulate_every_layout(two: FSDPWorkerGroup, b, layouts: dict, micro_counts: dict, m_ref, w_ref) -> None:
    for name, layout in layouts.items():
        runs = {}
        for no_sync in (True, False):
            g = reset(two, grad_accum_no_sync=no_sync, **layout)
            m = g.update(b)
            runs[no_sync] = (m, weights(g), _reduce_scatters(g))
            assert m["actor/grad_norm"] == pytest.approx(m_ref["actor/grad_norm"], rel=1e-4), (name, no_sync)
            for k in w_ref:
                assert torch.allclose(runs[no_sync][1][k], w_ref[k], rtol=1e-5, atol=1e-6), \
                    f"{name} no_sync={no_sync}: {k} differs by {float((runs[no_sync][1][k] - w_ref[k]).abs().max())}"
        for rank in (0, 1):
            on, off = (runs[v][2][rank] for v in (True, False))
            # per FSDP group: one reduce-scatter per mini-batch with no_sync, one per micro-batch without
            assert on > 0 and on * sum(micro_counts[name]) == off * len(micro_counts[name]), (name, rank, on, off)
        for k in w_ref:
            assert torch.allclose(runs[True][1][k], runs[False][1][k], rtol=1e-6, atol=1e-7), (name, k)


def test_accumulation_keeping_parameters_unsharded_with_gradient_checkpointing(groups, tiny_model_dir):
    """reshard_after_forward=false: between the micro-batches of a mini-batch the parameters stay unsharded
    (no re-all-gather for the next forward); with gradient checkpointing (recompute in backward) the step still
    equals one micro-batch on one rank."""
    b = _accumulation_batch()
    m_ref, w_ref = _one_micro_batch_reference(groups[1], b)
    a = "actor_rollout_ref.actor"
    group = FSDPWorkerGroup(compose_config(tiny_model_dir, *_overrides(2), f"{a}.fsdp_config.reshard_after_forward=false",
                                           "actor_rollout_ref.model.enable_gradient_checkpointing=true"),
                            name="test_fsdp_unsharded_accum")
    try:
        group.init()
        group.initial = groups[2].initial  # like every test here: start from the saved initial state
        reset(group, use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu=1)
        for step in range(2):  # the second step starts from parameters the first one left resharded
            m = group.update(b)
            if step == 0:
                assert m["actor/grad_norm"] == pytest.approx(m_ref["actor/grad_norm"], rel=1e-4)
                w = weights(group)
                for k in w_ref:
                    assert torch.allclose(w[k], w_ref[k], rtol=1e-5, atol=1e-6), \
                        f"{k} differs by {float((w[k] - w_ref[k]).abs().max())}"
        assert m["actor/optimizer_steps"] == 2.0 and m["actor/grad_norm"] > 0
    finally:
        group.shutdown()


def test_packed_and_padded_log_probs_agree(groups, batch):
    g = reset(groups[2], use_remove_padding=True)
    packed = g.compute_log_prob(batch)
    g.set_options(use_remove_padding=False, log_prob_use_dynamic_bsz=False, log_prob_micro_batch_size_per_gpu=3)
    padded = g.compute_log_prob(batch)
    assert torch.allclose(packed, padded, atol=2e-5)


def test_rollout_correction_weights_enter_the_loss(groups, batch):
    g = groups[2]
    plain = reset(g).update(batch)
    b = batch.clone()
    b["rollout_log_probs"] = b["old_log_probs"].clone()  # no mismatch: weights 1, nothing rejected
    same = reset(g, rollout_correction={"enable": True}).update(b)
    assert same["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], rel=1e-6)
    assert same["mismatch/train_rollout_logprob_abs_diff"] == 0.0
    masked = reset(g, rollout_correction={"enable": True, "mode": "mask", "upper": 1.01}).update(batch)
    assert masked["mismatch/mask_frac"] > 0
    assert masked["actor/pg_loss"] != pytest.approx(plain["actor/pg_loss"], rel=1e-3)


def test_save_load_continue_equals_uninterrupted(groups, tmp_path):
    g = reset(groups[2], shuffle=True, ppo_epochs=2)
    batches = [with_advantages(make_batch(groups=4, n=2, seed=30 + i), seed=i) for i in range(4)]
    for b in batches:
        b["old_log_probs"] = b["rollout_log_probs"]
        b["ref_log_prob"] = b["rollout_log_probs"]
    for b in batches[:2]:
        g.update(b)
    path = g.save_checkpoint(str(tmp_path), extra={"cursor": 7})
    assert path == latest_checkpoint(str(tmp_path)) and path.endswith(os.path.join("global_step_2", "actor"))
    straight = [g.update(b) for b in batches[2:]]
    w_straight = weights(g)
    assert g.load(path) == {"cursor": 7}
    assert g.global_step == 2
    resumed = [g.update(b) for b in batches[2:]]
    w_resumed = weights(g)
    for a, b in zip(straight, resumed):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/kl_loss"):
            assert a[key] == b[key], key
    assert all(torch.equal(w_straight[k], w_resumed[k]) for k in w_straight)
    lrs = [m["actor/lr"] for m in straight]
    assert lrs == pytest.approx([LR * lr_factor(s, kind="cosine", warmup_steps=0, total_steps=TOTAL_STEPS,
                                                min_lr_ratio=0.1) for s in (2, 3)])


def test_fresh_start_equals_resuming_its_initial_checkpoint(groups, batch, ray_session, tiny_model_dir, tmp_path):
    """A checkpoint taken before the first optimizer step changes nothing: a group that never saved, one that
    saved at its start and one that loaded such a checkpoint take the same first step (torch's get_state_dict
    initialises an empty AdamW state with a dummy step that left its step counter at 1: the first real step
    then ran with step 2's bias correction, about half a step off here)."""
    built = [FSDPWorkerGroup(compose_config(tiny_model_dir, *_overrides(1)), name=f"test_fsdp_fresh{i}")
             for i in range(2)]
    try:
        with ThreadPoolExecutor(len(built)) as pool:
            list(pool.map(lambda g: g.init(), built))
        never_saved, saved = built
        saved.save(str(tmp_path / "start"))
        runs = {}
        for name, g in (("never saved", never_saved), ("saved at start", saved),
                        ("loaded its start", reset(groups[1]))):
            g.set_options(**DEFAULTS)
            before = weights(g)
            m = g.update(batch)
            runs[name] = (before, m, weights(g))
        base_before, base_m, base_after = runs["never saved"]
        moved = max(float((base_after[k] - base_before[k]).abs().max()) for k in base_after)
        assert moved > 1e-4
        for name, (before, m, after) in runs.items():
            assert all(torch.equal(before[k], base_before[k]) for k in base_before), name
            assert m["actor/lr"] == base_m["actor/lr"] == pytest.approx(LR), name
            for k in base_after:
                assert torch.allclose(after[k], base_after[k], rtol=0, atol=1e-7), \
                    f"{name}: {k} differs by {float((after[k] - base_after[k]).abs().max())} (one step: {moved})"
    finally:
        for g in built:
            g.shutdown()


def test_checkpoint_reshards_across_world_sizes(groups, batch, tmp_path):
    two, one = reset(groups[2]), reset(groups[1])
    two.update(batch)
    two.save(str(tmp_path / "from2"), extra={"step": 1})
    assert one.load(str(tmp_path / "from2")) == {"step": 1} and one.global_step == two.global_step
    w2, w1 = weights(two), weights(one)
    assert all(torch.equal(w2[k], w1[k]) for k in w2)
    m2, m1 = two.update(batch), one.update(batch)  # optimizer state resharded too: the next step agrees
    assert m1["actor/pg_loss"] == pytest.approx(m2["actor/pg_loss"], rel=1e-5)
    w2, w1 = weights(two), weights(one)
    assert all(torch.allclose(w2[k], w1[k], rtol=1e-5, atol=1e-6) for k in w2)


def test_bad_input(groups, batch):
    g = reset(groups[2])
    with pytest.raises(ValueError, match="empty batch"):
        g.update(batch[:0])
    with pytest.raises(ValueError, match="empty batch"):
        g.compute_log_prob(batch[:0])
    g.set_options(ppo_max_token_len_per_gpu=6)
    with pytest.raises(ValueError, match=r"row \d+ has \d+ tokens .*ppo_max_token_len_per_gpu=6"):
        g.update(batch)
    g.set_options(ppo_max_token_len_per_gpu=24)
    nan = batch.clone()
    row, col = (batch["response_mask"] > 0).nonzero()[0].tolist()
    nan["advantages"][row, col] = float("nan")
    with pytest.raises(ValueError, match="advantages"):
        g.update(nan)
    missing = batch.exclude("old_log_probs")
    with pytest.raises(KeyError, match="old_log_probs"):
        g.update(missing)


def test_non_finite_loss_skips_the_step_and_keeps_weights(groups, batch):
    g = reset(groups[2])
    before = weights(g)
    huge = batch.clone()
    huge["advantages"] = batch["response_mask"] * 3e38  # finite input, the loss sum overflows to inf
    m = g.update(huge)
    assert m["actor/skipped_steps"] == 2.0 and m["actor/optimizer_steps"] == 0.0
    assert m["actor/total_skipped_steps"] >= 2.0
    after = weights(g)
    assert all(torch.equal(before[k], after[k]) for k in before)
    ok = g.update(batch)  # the group is still usable
    assert ok["actor/skipped_steps"] == 0.0 and ok["actor/optimizer_steps"] == 2.0


def test_update_profile_summary_per_rank_and_same_numbers(groups, batch, tmp_path):
    g = reset(groups[2])
    plain = g.update(batch)
    assert "perf/profile" not in plain
    expected = weights(g)
    g = reset(groups[2])
    m = g.update(batch, profile={"dir": str(tmp_path), "tag": "step"})
    assert all(torch.equal(expected[k], v) for k, v in weights(g).items()), "profiling changed the step"
    assert m["actor/loss"] == pytest.approx(plain["actor/loss"], abs=1e-6)
    summaries = m["perf/profile"]
    assert [s["rank"] for s in summaries] == [0, 1]
    for s in summaries:
        assert s["mode"] == "cpu" and os.path.getsize(s["trace"]) > 0
        assert s["trace"] == str(tmp_path / f"step_rank{s['rank']}.json.gz")
        cats = s["categories"]
        for c in ("attention", "gemm: mlp", "gemm: attn proj", "gemm: lm head", "logprob/entropy", "optimizer",
                  "comm: all-gather", "comm: reduce-scatter", "comm: all-reduce"):
            assert cats.get(c, 0) > 0, (c, cats)
        assert {"forward", "logprob", "loss", "backward", "grad_clip", "optimizer"} <= set(s["phases"])
        assert 0 < s["busy_ms"] <= s["wall_ms"]


def test_export_hf_loads_with_transformers(groups, batch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_async.algos import logprobs_from_logits
    from verl_async.trainer.batching import build_model_inputs

    g = reset(groups[2])
    g.update(batch)
    path = g.export_hf(str(tmp_path / "hf"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    AutoTokenizer.from_pretrained(path)
    inputs = build_model_inputs(batch, list(range(batch.batch_size[0])), packed=False, pad_token_id=0)
    with torch.no_grad():
        logits = model(**inputs.model_kwargs()).logits
    exported = inputs.scatter(logprobs_from_logits(logits, inputs.labels, 1.0))
    assert torch.allclose(exported, g.compute_log_prob(batch), atol=2e-5)
    sync = weights(g)
    params = dict(model.named_parameters())
    assert set(sync) == set(params)
    assert all(torch.equal(sync[k], params[k].detach()) for k in sync)


def test_weight_buckets_are_bounded(groups):
    g = groups[2]
    limit = 40_000
    buckets = [g.wait([ref], "bucket")[0] for ref in bucket_refs(g, limit)]
    assert len(buckets) > 1
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1
    names = [n for bucket in buckets for n, _ in bucket]
    assert len(names) == len(set(names)) and "model.embed_tokens.weight" in names
    for _ in zip(range(1), bucket_refs(g, limit)):  # a consumer that stops early leaves no rank stuck
        pass
    assert len(list(full_weights(g, limit))) == len(names)


def test_missing_resources_fail_at_once(ray_session, tiny_model_dir):
    too_many = FSDPWorkerGroup(compose_config(tiny_model_dir, "trainer.n_gpus_per_node=64"))
    with pytest.raises(WorkerGroupError, match=r"trainer.n_gpus_per_node=64 needs one node holding \{CPU: 12.8\}"):
        too_many.init()
    if not torch.cuda.is_available():
        gpu = FSDPWorkerGroup(compose_config(tiny_model_dir, "trainer.device=cuda"))
        with pytest.raises(WorkerGroupError, match=r"needs one node holding \{CPU: 1, GPU: 1\}, but none"):
            gpu.init()


def test_dead_worker_raises_clear_error(groups, batch):
    """Last: it breaks the 1-rank group on purpose."""
    import ray

    g = groups[1]
    ray.kill(g.workers[0])
    with pytest.raises(WorkerGroupError, match="rank 0 died"):
        g.update(batch)
    with pytest.raises(WorkerGroupError, match="unusable"):
        g.compute_log_prob(batch)
