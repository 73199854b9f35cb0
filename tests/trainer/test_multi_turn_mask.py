"""Multi-turn responses in the trainer: the loss mask keeps tool tokens out of every gradient and metric.

A multi-turn response holds model turns with tool answers between them (Response.loss_mask
0 there). collate_groups keeps the tool tokens in the layout (attention: the model reads
them) and out of `response_mask`, the loss mask that the loss, KL, entropy, advantages and
rollout correction take. Proven here by gradients through the trainer's own functions on a
real (tiny) model, packed and padded: the logits that predict tool tokens get exactly zero
gradient, and changing anything the batch says about tool tokens changes no loss or metric.
"""

from __future__ import annotations

import pytest
import torch

from verl_async.algos import compute_advantages, logprobs_and_entropy, rollout_correction
from verl_async.algos.advantages import compute_reinforce_plus_plus_advantage, scores_to_token_rewards
from verl_async.algos.policy_losses import POLICY_LOSSES
from verl_async.protocol import Response, RolloutSample, collate_groups
from verl_async.trainer.batching import build_model_inputs, gather_rows
from verl_async.trainer.loss import LossConfig, actor_loss

M, T = 1, 0  # a model token, a tool (inserted) token
# every policy loss's own keys, each at a value that makes its special branch act on this small batch
LOSS_PARAMS = dict(dro_beta=0.1, clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0, kl_cov_ratio=0.2,
                   ppo_kl_coef=0.5, tau_pos=1.0, tau_neg=1.05, rollout_rs="token_k1,seq_mean_k3",
                   rollout_rs_threshold="0.5_2.0,0.5", rollout_is="token", loss_type="ppo_clip")


def multi_turn_response(tokens, mask, version=3, reward=1.0) -> Response:
    return Response(token_ids=tokens, log_probs=[-0.5 if m else 0.0 for m in mask],
                    versions=[version if m else -1 for m in mask], finish_reason="stop", reward=reward,
                    loss_mask=list(mask))


def test_response_checks_and_versions_of_model_tokens_only():
    r = multi_turn_response([5, 6, 7, 8, 9], [M, M, T, T, M])
    assert r.model_tokens == 3 and len(r) == 5 and r.min_version == r.max_version == 3
    with pytest.raises(ValueError, match="loss_mask"):
        Response([1, 2], [0.0, 0.0], [0, 0], "stop", loss_mask=[1])
    with pytest.raises(ValueError, match="0 and 1"):
        Response([1, 2], [0.0, 0.0], [0, 0], "stop", loss_mask=[1, 2])
    group = RolloutSample("u", [1, 2], [r, multi_turn_response([4], [M], version=1)])
    assert group.min_version == 1 and group.max_version == 3
    assert RolloutSample.from_dict(group.to_dict()).responses[0].loss_mask == [M, M, T, T, M]


def test_collate_keeps_tool_tokens_in_the_layout_and_out_of_the_loss_mask():
    groups = [RolloutSample("g", [1, 2, 3], [multi_turn_response([5, 6, 7, 8, 9], [M, M, T, T, M]),
                                             Response([4, 4], [-0.1, -0.2], [2, 2], "stop")])]
    batch = collate_groups(groups, pad_token_id=0)
    assert batch["attention_mask"][:, 3:].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    assert batch["token_versions"].tolist() == [[3, 3, -1, -1, 3], [2, 2, -1, -1, -1]]
    assert batch["rollout_log_probs"][0].tolist() == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


def test_outcome_reward_sits_on_the_last_model_token_and_flows_across_tool_tokens():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    rewards = scores_to_token_rewards(torch.tensor([2.0, 5.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 2.0, 0, 0], [0, 0, 5.0, 0, 0, 0, 0, 0]]
    # REINFORCE++ on the holey row equals it on the row with the tool tokens taken out
    holey = torch.tensor([[0.0, 0.5, 9.0, 9.0, 0.0, 1.0]])
    holey_mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    compact = torch.tensor([[0.0, 0.5, 0.0, 1.0]])
    both = torch.cat([holey, torch.nn.functional.pad(compact, (0, 2))])
    both_mask = torch.cat([holey_mask, torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 0.0]])])
    adv = compute_reinforce_plus_plus_advantage(both, both_mask, gamma=0.9)
    assert torch.allclose(adv[0, [0, 1, 4, 5]], adv[1, :4], atol=1e-6)
    assert adv[0, 2] == adv[0, 3] == 0.0
    # before whitening: returns-to-go of the compact row are 0.5 + 0.9 * 0.9 * 1 ... (hand-computed)
    raw_first = 0.0 + 0.9 * (0.5 + 0.9 * (0.0 + 0.9 * 1.0))
    row = adv[1, :4]
    expected = torch.tensor([raw_first, 0.5 + 0.81, 0.9, 1.0])
    assert torch.allclose((row - row.mean()) / row.std(), (expected - expected.mean()) / expected.std(), atol=1e-4)


def _batch(vocab: int, seed: int, poison: bool):
    """Two groups of two; three responses are multi-turn. `poison`: tool tokens get other ids,
    absurd rollout log-probs and versions (nothing the trainer reads at tool positions may matter)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    masks = [[M, M, M, T, T, T, M, M], [M, M, M, M], [M, T, T, M, M, T, T, M, M], [M, M, T, M]]
    groups = []
    for gi in range(2):
        responses = []
        for k in range(2):
            mask = masks[gi * 2 + k]
            r = multi_turn_response(ids(len(mask)), mask, reward=float(gi + k))
            responses.append(r)
        groups.append(RolloutSample(f"g{gi}", ids(3 + gi), responses))
    if poison:
        for s in groups:
            for r in s.responses:
                for i, m in enumerate(r.loss_mask):
                    if not m:
                        r.log_probs[i], r.versions[i] = -40.0, 99
    return collate_groups(groups, pad_token_id=0)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from verl_async.models.loading import load_causal_lm

    torch.manual_seed(0)
    return load_causal_lm(tiny_model_dir, attn_implementation="eager").float().train()


@pytest.mark.parametrize("packed,loss_mode", [(True, "vanilla"), (False, "vanilla")] + [
    (packed, mode) for mode in POLICY_LOSSES if mode != "vanilla" for packed in (mode in ("gspo", "bypass_mode"),)])
def test_tool_token_logits_get_zero_gradient_and_change_no_loss(tiny_model, packed, loss_mode):
    """Every policy loss (verl 0.9's loss_mode registry): tool tokens get no gradient and change nothing."""
    vocab = tiny_model.config.vocab_size
    cfg = LossConfig(loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                     entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                     loss_mode=loss_mode, policy_loss=LOSS_PARAMS)

    def step(poison: bool):
        torch.manual_seed(0)  # clip_cov draws its detached tokens from the global generator
        batch = _batch(vocab, seed=1, poison=poison)
        mask = batch["response_mask"]
        tool = (batch["attention_mask"][:, batch["prompts"].shape[1]:] == 1) & (mask == 0)
        gen = torch.Generator().manual_seed(2)
        old = (-torch.rand(mask.shape, generator=gen) * 2)
        ref = old + 0.1 * torch.randn(mask.shape, generator=gen)
        if poison:  # what the batch says about tool tokens: all nonsense, must not matter
            old, ref = torch.where(tool, -30.0, old), torch.where(tool, 5.0, ref)
        batch["old_log_probs"], batch["ref_log_prob"] = old * (mask + tool), ref * (mask + tool)
        batch["advantages"] = compute_advantages("grpo", batch["scores"], batch["group_index"], mask)
        weights, loss_mask, rc_metrics = rollout_correction(batch["old_log_probs"], batch["rollout_log_probs"], mask,
                                                            level="sequence", mode="truncate", upper=2.0)
        batch["is_weights"], batch["loss_mask"] = weights, loss_mask.float()
        rows = list(range(batch.batch_size[0]))
        inp = build_model_inputs(batch, rows, packed=packed, pad_token_id=0)
        tiny_model.zero_grad(set_to_none=True)
        logits = tiny_model(**inp.model_kwargs()).logits
        logits.retain_grad()
        raw_logp, raw_ent = logprobs_and_entropy(logits, inp.labels.to(logits.device), 1.0)
        logp, ent = inp.scatter(raw_logp), inp.scatter(raw_ent)
        data = gather_rows(batch, rows, ["loss_mask", "old_log_probs", "advantages", "is_weights", "ref_log_prob"])
        loss, metrics = actor_loss(logp, ent, data, cfg, global_tokens=float(loss_mask.sum()),
                                   global_seqs=float((loss_mask.sum(-1) > 0).sum()), loss_scale_factor=16)
        loss.backward()
        return inp, logits.grad.reshape(-1, logits.shape[-1]), mask, tool, float(loss.detach()), metrics, rc_metrics

    inp, grad, mask, tool, loss, metrics, rc = step(poison=False)
    assert int(tool.sum()) == 8 and int(mask.sum()) == 17
    zero = nonzero = 0
    for n in range(inp.src.numel()):
        g = grad[inp.src[n]]
        row, col = int(inp.dst_row[n]), int(inp.dst_col[n])
        if tool[row, col]:
            assert float(g.abs().max()) == 0.0, f"tool token ({row}, {col}) got a gradient"
            zero += 1
        else:
            assert mask[row, col] == 1 and float(g.abs().max()) > 0, f"model token ({row}, {col}) got none"
            nonzero += 1
    assert (zero, nonzero) == (8, 17)
    _, _, _, _, loss_poisoned, metrics_poisoned, rc_poisoned = step(poison=True)
    assert loss_poisoned == pytest.approx(loss, rel=1e-6, abs=1e-8)
    for key, value in metrics.items():
        assert metrics_poisoned[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for key, value in rc.items():
        assert rc_poisoned[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("mode,loss_mode", [(m, "vanilla") for m in ("token-mean", "seq-mean-token-mean",
                                                                      "seq-mean-token-sum-norm", "token-sum")] + [
    ("seq-mean-token-sum", m) for m in POLICY_LOSSES if m not in ("vanilla", "clip_cov", "kl_cov")])
def test_micro_batches_of_multi_turn_rows_add_up_to_the_mini_batch(mode, loss_mode):
    """The update plan's normalisers count model tokens only; split any way, the shares sum to the whole.

    For every policy loss but clip_cov and kl_cov, whose token selection is the micro-batch's own (as in verl)."""
    from verl_async.trainer.batching import plan_update, sequence_lengths

    batch = _batch(vocab=200, seed=4, poison=False)
    mask = batch["response_mask"]
    gen = torch.Generator().manual_seed(5)
    batch["old_log_probs"] = -torch.rand(mask.shape, generator=gen) * mask
    batch["advantages"] = compute_advantages("grpo", batch["scores"], batch["group_index"], mask)
    batch["loss_mask"] = mask
    logp = (batch["old_log_probs"] + 0.2 * torch.randn(mask.shape, generator=gen)).requires_grad_(True)
    cfg = LossConfig(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                     entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="kl", loss_mode=loss_mode,
                     policy_loss=LOSS_PARAMS)
    p, r = sequence_lengths(batch)
    assert r.tolist() == [8, 4, 9, 4]  # the layout counts tool tokens (they are forwarded)
    (plan,) = plan_update(batch["group_index"], (p + r).tolist(), mask, mini_groups=2, epochs=1, shuffle=False,
                          seed=0, dp=1, dynamic=True, micro_size=1, max_tokens=16)
    assert plan.num_tokens == 17.0  # model tokens only
    keys = ["loss_mask", "old_log_probs", "advantages"]
    norm = dict(global_tokens=plan.num_tokens, global_seqs=plan.num_seqs, loss_scale_factor=16)
    full, _ = actor_loss(logp, None, gather_rows(batch, range(4), keys), cfg, **norm)
    (g_full,) = torch.autograd.grad(full, [logp])
    total, grads = 0.0, torch.zeros_like(logp)
    micro = plan.micro[0]
    assert len(micro) > 1
    for rows in micro:
        loss, _ = actor_loss(logp[torch.tensor(rows)], None, gather_rows(batch, rows, keys), cfg, **norm)
        total = total + loss
        grads = grads + torch.autograd.grad(loss, [logp])[0]
    assert float(total.detach()) == pytest.approx(float(full.detach()), rel=1e-5, abs=1e-7)
    assert torch.allclose(grads, g_full, atol=1e-7) and float(grads[mask == 0].abs().max()) == 0.0
