"""Trainer pieces without Ray or a process group: plans, model inputs, loss shares, schedule, settings."""

from __future__ import annotations

import math
import os

import pytest
import torch
from trainer_helpers import make_batch, with_advantages

from verl_async import checkpoint as ckpt
from verl_async.trainer.attention import resolve_attn_implementation
from verl_async.trainer.batching import (
    build_model_inputs,
    check_batch,
    check_lengths,
    gather_rows,
    plan_forward,
    plan_update,
    sequence_lengths,
)
from verl_async.trainer.loss import LossConfig, actor_loss
from verl_async.trainer.lr_schedule import lr_factor
from verl_async.trainer.settings import TrainerSettings

LOSS_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _weights(batch):
    p, r = sequence_lengths(batch)
    return check_lengths(p, r, None, "k")


# ---------------------------------------------------------------- plans
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_plan_forward_covers_every_row_once_with_equal_micro_counts(dynamic, dp):
    batch = make_batch(groups=5, n=3, seed=dp)
    weights = _weights(batch)
    plan = plan_forward(weights, dp, dynamic=dynamic, micro_size=2, max_tokens=30)
    assert len(plan) == dp
    assert len({len(rank) for rank in plan}) == 1, "every rank runs the same number of micro-batches"
    rows = sorted(i for rank in plan for micro in rank for i in micro)
    assert rows == list(range(len(weights)))
    for rank in plan:
        for micro in rank:
            if dynamic:
                assert sum(weights[i] for i in micro) <= 30
            else:
                assert len(micro) <= 2


def test_plan_forward_balances_tokens_over_ranks():
    weights = [100, 90, 60, 50, 40, 10]
    plan = plan_forward(weights, 2, dynamic=True, micro_size=1, max_tokens=1000)
    loads = [sum(weights[i] for micro in rank for i in micro) for rank in plan]
    assert max(loads) - min(loads) <= 10


def test_plan_update_keeps_groups_whole_and_counts_normalisers():
    batch = make_batch(groups=6, n=2, seed=3, empty_response_rows=1)
    weights = _weights(batch)
    mask = batch["response_mask"]
    plans = plan_update(batch["group_index"], weights, mask, mini_groups=4, epochs=2, shuffle=True, seed=7, dp=2,
                        dynamic=True, micro_size=1, max_tokens=40)
    assert len(plans) == 4  # 2 epochs x ceil(6 / 4) mini-batches
    for epoch in (0, 1):
        seen = sorted(i for p in plans if p.epoch == epoch for i in p.rows)
        assert seen == list(range(12))
    for p in plans:
        groups = {int(batch["group_index"][i]) for i in p.rows}
        assert sorted(p.rows) == sorted(i for i in range(12) if int(batch["group_index"][i]) in groups)
        assert p.num_tokens == float(mask[p.rows].sum())
        assert p.num_seqs == float((mask[p.rows].sum(-1) > 0).sum())
        assert sorted(i for rank in p.micro for m in rank for i in m) == p.rows
    again = plan_update(batch["group_index"], weights, mask, mini_groups=4, epochs=2, shuffle=True, seed=7, dp=2,
                        dynamic=True, micro_size=1, max_tokens=40)
    assert [p.rows for p in again] == [p.rows for p in plans], "the plan is a pure function of its seed"


def test_overlong_row_error_names_both_numbers():
    batch = make_batch(groups=2, n=2, seed=1, prompt_len=(5, 5), response_len=(10, 10))
    p, r = sequence_lengths(batch)
    with pytest.raises(ValueError, match=r"15 tokens.*ppo_max_token_len_per_gpu=12"):
        check_lengths(p, r, 12, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu")


def test_check_batch_refuses_empty_and_missing_keys():
    batch = make_batch(groups=1, n=2)
    with pytest.raises(ValueError, match="empty batch"):
        check_batch(batch[:0], ["prompts"], "update")
    with pytest.raises(KeyError, match="advantages"):
        check_batch(batch, ["prompts", "advantages"], "update")


# ---------------------------------------------------------------- model inputs
@pytest.fixture(scope="module")
def tiny_models(tiny_model_dir):
    from verl_async.models.loading import load_causal_lm

    out = {}
    for impl in ("sdpa", "eager", "varlen"):
        resolve_attn_implementation(impl, "cpu")
        out[impl] = load_causal_lm(tiny_model_dir, attn_implementation=impl).eval()
    return out


def _logp(model, inputs):
    from verl_async.algos import logprobs_from_logits

    with torch.no_grad():
        logits = model(**inputs.model_kwargs()).logits
        return inputs.scatter(logprobs_from_logits(logits, inputs.labels, 1.0))


def test_packed_forward_equals_padded_forward(tiny_models):
    batch = make_batch(groups=3, n=3, seed=5, prompt_len=(1, 9), response_len=(0, 12))
    rows = list(range(9))
    padded = build_model_inputs(batch, rows, packed=False, pad_token_id=0)
    packed = build_model_inputs(batch, rows, packed=True, pad_token_id=0, with_varlen_kwargs=True)
    assert packed.input_ids.shape[0] == 1 and packed.attention_mask is None
    assert packed.num_tokens == int(batch["attention_mask"].sum()) < padded.num_tokens
    ref = _logp(tiny_models["eager"], padded)
    mask = batch["response_mask"]
    assert ref.shape == mask.shape and bool((ref[mask == 0] == 0).all())
    for impl in ("sdpa", "eager", "varlen"):
        for name, inputs in (("padded", padded), ("packed", packed)):
            got = _logp(tiny_models[impl], inputs)
            assert torch.allclose(got, ref, atol=2e-5), f"{impl} {name}: {float((got - ref).abs().max())}"


def test_packed_forward_matches_one_sequence_at_a_time(tiny_models):
    """Packing must not leak attention across sequences: compare with each row alone."""
    batch = make_batch(groups=2, n=2, seed=9)
    packed = _logp(tiny_models["sdpa"], build_model_inputs(batch, [0, 1, 2, 3], packed=True, pad_token_id=0))
    for i in range(4):
        alone = _logp(tiny_models["sdpa"], build_model_inputs(batch, [i], packed=False, pad_token_id=0))
        assert torch.allclose(packed[i], alone[0], atol=2e-5)


def test_dummy_micro_batch_contributes_nothing():
    batch = make_batch(groups=1, n=2)
    inputs = build_model_inputs(batch, [], packed=True, pad_token_id=0)
    assert inputs.num_rows == 0 and inputs.input_ids.shape == (1, 1)
    assert inputs.scatter(torch.ones(1, 1)).shape == (0, batch["responses"].shape[1])


# ---------------------------------------------------------------- loss shares
def _loss_inputs(seed=0):
    batch = with_advantages(make_batch(groups=4, n=2, seed=seed, empty_response_rows=1), seed=seed)
    mask = batch["response_mask"]
    gen = torch.Generator().manual_seed(seed)
    old = (-torch.rand(mask.shape, generator=gen) * 2) * mask
    batch["old_log_probs"] = old
    batch["ref_log_prob"] = (old + 0.1 * torch.randn(mask.shape, generator=gen)) * mask
    batch["loss_mask"] = mask
    logp = (old + 0.3 * torch.randn(mask.shape, generator=gen)).requires_grad_(True)
    ent = (torch.rand(mask.shape, generator=gen) * 3).requires_grad_(True)
    return batch, logp, ent


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_micro_batch_shares_add_up_to_the_full_batch_loss_and_gradient(mode):
    batch, logp, ent = _loss_inputs()
    cfg = LossConfig(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                     entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    mask = batch["response_mask"]
    width = mask.shape[1]
    norm = dict(global_tokens=float(mask.sum()), global_seqs=float((mask.sum(-1) > 0).sum()),
                loss_scale_factor=width + 3)
    keys = ["loss_mask", "old_log_probs", "advantages", "ref_log_prob"]
    full_loss, full_m = actor_loss(logp, ent, gather_rows(batch, range(8), keys), cfg, **norm)
    g_full = torch.autograd.grad(full_loss, [logp, ent])
    total = 0.0
    shares: dict[str, float] = {}
    grads = [torch.zeros_like(logp), torch.zeros_like(ent)]
    for rows in ([0, 5], [1, 2, 3], [4], [6, 7]):
        idx = torch.tensor(rows)
        lp, en = logp[idx], ent[idx]
        loss, m = actor_loss(lp, en, gather_rows(batch, rows, keys), cfg, **norm)
        total = total + loss
        for k, v in m.items():
            shares[k] = shares.get(k, 0.0) + v
        g = torch.autograd.grad(loss, [logp, ent])
        grads = [a + b for a, b in zip(grads, g)]
    assert math.isclose(float(total.detach()), float(full_loss.detach()), rel_tol=1e-5, abs_tol=1e-7)
    for k in full_m:
        assert math.isclose(shares[k], full_m[k], rel_tol=1e-5, abs_tol=1e-7), k
    for a, b in zip(grads, g_full):
        assert torch.allclose(a, b, atol=1e-7)


# ---------------------------------------------------------------- lr schedule, settings, checkpoint layout
def test_lr_factor_constant_and_cosine_with_warmup():
    assert [lr_factor(s, kind="constant", warmup_steps=4, total_steps=10) for s in range(6)] == \
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    f = [lr_factor(s, kind="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1) for s in range(13)]
    assert f[0] == pytest.approx(0.1) and f[2] == pytest.approx(1.0)
    assert f[7] == pytest.approx(0.55) and f[12] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[2:], f[3:]))


def test_settings_errors_name_the_key(config_factory):
    from omegaconf import OmegaConf

    base = OmegaConf.to_container(config_factory(), resolve=True)
    s = TrainerSettings.from_config(base)
    assert s.ppo_mini_batch_size == 8 and s.rollout_n == 8 and s.world_size == 1
    bad = OmegaConf.to_container(config_factory("actor_rollout_ref.actor.loss_agg_mode=mean"), resolve=True)
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.loss_agg_mode"):
        TrainerSettings.from_config(bad)
    cos = OmegaConf.to_container(config_factory("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"),
                                 resolve=True)
    with pytest.raises(ValueError, match="total_training_steps"):
        TrainerSettings.from_config(cos)
    with pytest.raises(ValueError, match="cannot change"):
        s.with_overrides({"model_path": "x"})
    with pytest.raises(ValueError, match="reference model"):
        s.with_overrides({"use_kl_loss": True})
    assert s.with_overrides({"loss_agg_mode": "seq-mean-token-sum"}).loss_agg_mode == "seq-mean-token-sum"


def test_cpu_threads_per_worker_is_a_trainer_setting(config_factory):
    from omegaconf import OmegaConf

    def parse(*overrides):
        return TrainerSettings.from_config(OmegaConf.to_container(config_factory(*overrides), resolve=True))

    assert parse().cpu_threads_per_worker == 1
    assert parse("trainer.cpu_threads_per_worker=3").cpu_threads_per_worker == 3
    with pytest.raises(ValueError, match=r"trainer\.cpu_threads_per_worker must be a positive integer"):
        parse("trainer.cpu_threads_per_worker=0")


def test_checkpoint_rotation_and_latest(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3, 4):
        path = ckpt.checkpoint_dir(root, step)
        os.makedirs(path)
        if step != 4:  # step 4 never completed
            open(os.path.join(path, ckpt.COMPLETE_MARKER), "w").close()
    assert ckpt.latest_checkpoint(root) == ckpt.checkpoint_dir(root, 3)
    ckpt.mark_latest(root, 2)
    assert ckpt.latest_checkpoint(root) == ckpt.checkpoint_dir(root, 2)
    removed = ckpt.rotate_checkpoints(root, 2)
    assert [os.path.basename(r) for r in removed] == ["global_step_1"]
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 3]
    assert ckpt.rotate_checkpoints(root, None) == []


@pytest.mark.parametrize("signature", ["is_causal", "window", "window_gqa"])
def test_torch_varlen_kernel_plumbing_across_signatures(monkeypatch, signature):
    """The CUDA varlen call (shapes, causality, GQA, scale) against the exact loop, with a CPU stand-in kernel
    that has each torch version's signature (2.9/2.10: is_causal; later: window_size, then enable_gqa)."""
    import torch.nn.functional as F

    from verl_async.trainer import attention

    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=None, window_size=None, enable_gqa=None, scale=None):
        calls.append(dict(is_causal=is_causal, window_size=window_size, enable_gqa=enable_gqa, scale=scale))
        assert is_causal is True or tuple(window_size) == (-1, 0)
        assert cu_q.dtype == torch.int32 and max_q == int((cu_q[1:] - cu_q[:-1]).max())
        if k.shape[1] != q.shape[1]:
            assert enable_gqa
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = [F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                                              is_causal=True, scale=scale).transpose(0, 1)
               for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]
        return torch.cat(out)

    params = {"is_causal": {"is_causal"}, "window": {"window_size", "scale"},
              "window_gqa": {"window_size", "scale", "enable_gqa"}}[signature]
    monkeypatch.setattr(attention, "_torch_varlen", lambda: (kernel, frozenset(params)))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 11, 8, generator=gen) for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 4, 11])
    got = attention._causal_varlen_cuda(q, k, v, cu, 7, 8 ** -0.5)
    want = attention._causal_sdpa_loop(q, k, v, cu, 8 ** -0.5)
    assert got.shape == want.shape == (1, 11, 4, 8)
    assert torch.allclose(got, want, atol=1e-6)
    assert calls and (calls[0]["enable_gqa"] is True) == (signature == "window_gqa")


def test_use_torch_compile_is_read_for_actor_and_ref(config_factory):
    from omegaconf import OmegaConf

    def settings(*overrides):
        return TrainerSettings.from_config(OmegaConf.to_container(config_factory(*overrides), resolve=True))

    s = settings()
    assert (s.use_torch_compile, s.ref_use_torch_compile) == (False, False)
    s = settings("actor_rollout_ref.actor.use_torch_compile=true")  # ref inherits the actor's (YAML interpolation)
    assert (s.use_torch_compile, s.ref_use_torch_compile) == (True, True)
    s = settings("actor_rollout_ref.actor.use_torch_compile=true", "actor_rollout_ref.ref.use_torch_compile=false")
    assert (s.use_torch_compile, s.ref_use_torch_compile) == (True, False)
    s = settings("actor_rollout_ref.ref.use_torch_compile=true")
    assert (s.use_torch_compile, s.ref_use_torch_compile) == (False, True)


@pytest.mark.parametrize("actor_flag, ref_flag", [(True, False), (False, True)])
def test_fsdp_and_megatron_log_probs_pass_the_compile_flag(monkeypatch, actor_flag, ref_flag):
    """The actor's forward (training and old log-probs) follows actor.use_torch_compile, the
    reference model's follows ref.use_torch_compile, in both workers."""
    import contextlib
    from types import SimpleNamespace

    from verl_async.trainer import fsdp_worker
    from verl_async.trainer.megatron import worker as megatron_worker

    seen = []

    def fake(name):
        def f(logits, labels, temperature, *, use_torch_compile):
            seen.append((name, use_torch_compile))
            z = torch.zeros(labels.shape)
            return (z, z) if name == "both" else z
        return f

    settings = SimpleNamespace(temperature=1.0, use_torch_compile=actor_flag, ref_use_torch_compile=ref_flag,
                               true_on_policy_span=None)
    for module in (fsdp_worker, megatron_worker):
        monkeypatch.setattr(module, "logprobs_and_entropy", fake("both"))
        monkeypatch.setattr(module, "logprobs_from_logits", fake("logp"))
    inp = SimpleNamespace(labels=torch.zeros(1, 3, dtype=torch.long), logits_index=torch.arange(3),
                          model_kwargs=dict, scatter=lambda t: t)
    inp.to = lambda device: inp
    model = lambda **kw: SimpleNamespace(logits=torch.zeros(1, 3, 5))  # noqa: E731
    fsdp_self = SimpleNamespace(settings=settings, device=SimpleNamespace(torch_device="cpu"), sp=None,
                                _range=lambda phase: contextlib.nullcontext())
    meg_self = SimpleNamespace(settings=settings, spec=SimpleNamespace(vocab_size=5))
    for use_ref in (False, True):
        for with_entropy in (True, False):
            fsdp_worker.FSDPWorker._forward(fsdp_self, model, inp, with_entropy=with_entropy, use_ref=use_ref)
            megatron_worker.MegatronWorker._log_probs(meg_self, torch.zeros(1, 3, 5), inp, with_entropy=with_entropy,
                                                      use_ref=use_ref)
    want = lambda use_ref: ref_flag if use_ref else actor_flag  # noqa: E731
    assert seen == [(name, want(r)) for r in (False, True) for name in ("both", "both", "logp", "logp")]


def test_fsdp_compute_log_prob_marks_the_reference_forward():
    from types import SimpleNamespace

    from verl_async.trainer.fsdp_worker import FSDPWorker

    calls = []
    model, ref = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)

    def forward(m, inp, *, with_entropy, use_ref=False):
        calls.append((m is ref, use_ref))
        return torch.zeros(1, 2), None, None

    fake = SimpleNamespace(model=model, ref_model=ref, _load_if_offloaded=lambda: None,
                           _offload_if_asked=lambda: None, _inputs=lambda b, rows: None, _forward=forward,
                           settings=SimpleNamespace(lora=None))
    batch = {"responses": torch.zeros(1, 2)}
    for use_ref in (False, True):
        FSDPWorker.compute_log_prob(fake, batch, [[0]], use_ref=use_ref)
    assert calls == [(False, False), (True, True)]


def test_log_prob_pass_restores_the_training_flag_and_offloads_even_on_error():
    from verl_async.trainer.common import eval_mode, log_prob_model

    model, ref = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).eval()
    with pytest.raises(RuntimeError, match="compute_ref_log_prob: no reference model"):
        log_prob_model(model, None, use_ref=True)
    assert log_prob_model(model, None, use_ref=False) is model and log_prob_model(model, ref, use_ref=True) is ref
    offloads = []
    with eval_mode(model, after=lambda: offloads.append("model")):
        assert not model.training and not offloads
    assert model.training and offloads == ["model"]
    with pytest.raises(ValueError, match="boom"):
        with eval_mode(ref, after=lambda: offloads.append("ref")):
            raise ValueError("boom")
    assert not ref.training and offloads == ["model", "ref"]  # an eval-mode model stays in eval mode
