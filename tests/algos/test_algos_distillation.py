"""On-policy distillation losses (verl_async/algos/distillation.py): hand values, and oracle-equal to verl 0.9.1's
own functions (`verl.trainer.distillation.losses.distillation_loss`, its KL estimator and FSDP top-k forward KL) on
random inputs, masks with holes (multi-turn tool tokens) included.

verl is a test-only dependency installed without its own dependencies (scripts/setup.sh: it pins an older
transformers and tensordict than verl_async's; the loss modules need neither at those versions)."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from verl_async.algos import LOSS_AGG_MODES
from verl_async.algos.distillation import (
    ESTIMATOR_MODES,
    DistillationLoss,
    combine_with_policy_loss,
    distillation_loss,
    forward_kl_topk,
    topk_log_probs,
)


def test_forward_kl_topk_hand_values():
    teacher = torch.log(torch.tensor([[0.5, 0.25]]))
    student = torch.log(torch.tensor([[0.25, 0.25]]))
    loss, s_mass, t_mass = forward_kl_topk(student, teacher)
    # 0.5 (log .5 - log .25) + 0.25 * 0 = 0.5 log 2
    assert float(loss) == pytest.approx(0.5 * math.log(2))
    assert (float(s_mass), float(t_mass)) == (pytest.approx(0.5), pytest.approx(0.75))
    # the student above the teacher on its top-k: negative, clamped at 0
    assert float(forward_kl_topk(teacher, student)[0]) == 0.0
    # log_prob_min_clamp lifts both before the KL
    low = forward_kl_topk(torch.tensor([[-30.0]]), torch.tensor([[-1.0]]), log_prob_min_clamp=-5.0)[0]
    assert float(low) == pytest.approx(math.exp(-1.0) * (-1.0 + 5.0))


def test_topk_log_probs_is_the_log_softmax_gathered():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g)
    ids = torch.randint(0, 11, (7, 3), generator=g)
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, ids)
    torch.testing.assert_close(topk_log_probs(logits, ids, 0.7, chunk=3), expected)


def test_estimator_policy_gradient_and_combination_hand_values():
    logp = torch.tensor([[-1.0, -2.0, 0.0]])
    teacher = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    cfg = DistillationLoss(loss_mode="k1", use_policy_gradient=False)
    loss, metrics = distillation_loss(cfg, logp, logp, mask, "token-mean", teacher_logp=teacher)
    assert float(loss) == pytest.approx((0.5 - 1.0) / 2)  # k1 = s - t over the two valid tokens
    assert (metrics["loss_min"], metrics["loss_max"], metrics["abs_loss"]) == (-1.0, 0.5, 0.75)
    clamped = distillation_loss(DistillationLoss(loss_mode="k1", loss_max_clamp=0.25), logp, logp, mask, "token-mean",
                                teacher_logp=teacher)[0]
    assert float(clamped) == pytest.approx((0.25 - 0.25) / 2)
    # policy gradient at ratio 1: -A = loss per token, so the value equals the direct loss
    pg = distillation_loss(DistillationLoss(loss_mode="k1", use_policy_gradient=True), logp, logp, mask, "token-mean",
                           teacher_logp=teacher)[0]
    assert float(pg) == pytest.approx(float(loss))
    policy, distill = torch.tensor(2.0), torch.tensor(3.0)
    assert float(combine_with_policy_loss(DistillationLoss(distillation_loss_coef=0.5), policy, distill)) == 3.5
    assert float(combine_with_policy_loss(DistillationLoss(use_task_rewards=False, distillation_loss_coef=0.5),
                                          policy, distill)) == 3.0  # without task rewards: coefficient 1, no policy


def test_padding_never_reaches_the_loss():
    logp = torch.tensor([[-1.0, float("nan")]])
    teacher = torch.tensor([[-2.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, _ = distillation_loss(DistillationLoss(loss_mode="k3"), logp.nan_to_num(0.0), logp.nan_to_num(0.0), mask,
                                "token-mean", teacher_logp=teacher)
    assert torch.isfinite(loss)


# --------------------------------------------------------------------------- oracle: verl 0.9.1
verl_losses = pytest.importorskip("verl.trainer.distillation.losses", reason="verl 0.9.1 (scripts/setup.sh)")


def _layout(seed: int, batch: int = 4, vocab: int = 13):
    """Random prompts/responses and the same values in verl's packed (thd) layout and in verl_async's [B, T]."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, 4, (batch,), generator=g)
    r_len = torch.randint(1, 6, (batch,), generator=g)
    P, T = int(p_len.max()), int(r_len.max())
    mask = torch.zeros(batch, T)
    for i in range(batch):
        mask[i, : r_len[i]] = (torch.rand(int(r_len[i]), generator=g) > 0.25).float()  # holes: tool tokens
        mask[i, 0] = 1.0
    attention = torch.zeros(batch, P + T, dtype=torch.long)
    for i in range(batch):
        attention[i, P - p_len[i]: P] = 1
        attention[i, P: P + r_len[i]] = 1
    data = TensorDict({"prompts": torch.zeros(batch, P, dtype=torch.long),
                       "responses": torch.zeros(batch, T, dtype=torch.long), "attention_mask": attention,
                       "response_mask": mask}, batch_size=[batch])
    nnz = int((p_len + r_len).sum())
    # flat index of the output that predicts response token j of row i (verl shifts the packed output by one)
    where = torch.full((batch, T), -1, dtype=torch.long)
    offset = 0
    for i in range(batch):
        for j in range(int(r_len[i])):
            where[i, j] = offset + int(p_len[i]) + j - 1
        offset += int(p_len[i] + r_len[i])
    return g, data, mask, where, nnz, vocab


def _pack(padded: torch.Tensor, where: torch.Tensor, nnz: int, fill: float = 0.0) -> torch.Tensor:
    """[B, T, ...] -> [nnz, ...] at the packed positions (the rest `fill`)."""
    out = torch.full((nnz, *padded.shape[2:]), fill, dtype=padded.dtype)
    valid = where >= 0
    out[where[valid]] = padded[valid]
    return out


def _verl_configs(cfg: DistillationLoss, agg: str):
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    loss_cfg = DistillationLossConfig(loss_mode=cfg.loss_mode, topk=cfg.topk, use_task_rewards=cfg.use_task_rewards,
                                      loss_max_clamp=cfg.loss_max_clamp, log_prob_min_clamp=cfg.log_prob_min_clamp,
                                      use_policy_gradient=cfg.use_policy_gradient, clip_ratio_low=cfg.clip_ratio_low,
                                      clip_ratio_high=cfg.clip_ratio_high)
    actor = SimpleNamespace(loss_agg_mode=agg, global_batch_info={}, loss_scale_factor=None, strategy="fsdp")
    return actor, DistillationConfig(enabled=False, distillation_loss=loss_cfg)


def _batch_info(data, mask):
    data.set_non_tensor("dp_size", 1)
    data.set_non_tensor("batch_num_tokens", mask.sum())
    data.set_non_tensor("global_batch_size", (mask.sum(-1) > 0).sum())


def _nested(flat: torch.Tensor, data) -> torch.Tensor:
    """[nnz, ...] -> a jagged nested tensor of one sequence per row (verl's packed batch layout)."""
    from torch.nested import nested_tensor

    lens = [int(x) for x in data["attention_mask"].sum(-1)]
    return nested_tensor(list(torch.split(flat, lens)), layout=torch.jagged)


def _ours(cfg, logp, old, mask, agg, **kw):
    return distillation_loss(cfg, logp, old, mask, agg, global_tokens=mask.sum(), global_seqs=(mask.sum(-1) > 0).sum(),
                             **kw)


CASES = [(mode, agg, pg, clamp) for mode, agg, pg, clamp in
         itertools.product(ESTIMATOR_MODES, LOSS_AGG_MODES, (False, True), (None, 0.5))
         if not (mode == "k1" and not pg)]  # verl refuses k1 as a direct loss (so does the config here)


@pytest.mark.parametrize("mode, agg, pg, clamp", CASES)
def test_estimator_losses_equal_verls(mode, agg, pg, clamp):
    g, data, mask, where, nnz, _ = _layout(hash((mode, agg, pg, clamp)) % 1000)
    logp = -torch.rand(mask.shape, generator=g) * 3
    old = logp.detach() + 0.1 * torch.randn(mask.shape, generator=g)
    teacher = -torch.rand(mask.shape, generator=g) * 3
    cfg = DistillationLoss(loss_mode=mode, use_policy_gradient=pg, loss_max_clamp=clamp, clip_ratio_low=0.2,
                           clip_ratio_high=0.28)
    actor, dist = _verl_configs(cfg, agg)
    data["teacher_logprobs"] = _nested(_pack(teacher, where, nnz).unsqueeze(-1), data)
    data["old_log_probs"] = old
    _batch_info(data, mask)
    theirs, their_metrics = verl_losses.distillation_loss(actor, dist, {"log_probs": _pack(logp, where, nnz)}, data)
    ours, metrics = _ours(cfg, logp, old, mask, agg, teacher_logp=teacher)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-6)
    assert metrics["loss_max"] == pytest.approx(their_metrics["distillation/loss_max"].aggregate(), rel=1e-5)
    assert metrics["abs_loss"] == pytest.approx(their_metrics["distillation/abs_loss"].aggregate(), rel=1e-5)


@pytest.mark.parametrize("agg, pg, clamps", list(itertools.product(LOSS_AGG_MODES, (False, True),
                                                                    ((None, None), (1.0, -4.0)))))
def test_topk_forward_kl_equals_verls(agg, pg, clamps):
    from torch.nested import nested_tensor
    from verl.trainer.distillation.fsdp.losses import compute_forward_kl_topk

    g, data, mask, where, nnz, vocab = _layout(7 + hash((agg, pg, clamps)) % 1000)
    k = 4
    cfg = DistillationLoss(loss_mode="forward_kl_topk", topk=k, use_policy_gradient=pg, loss_max_clamp=clamps[0],
                           log_prob_min_clamp=clamps[1])
    actor, dist = _verl_configs(cfg, agg)
    logits = torch.randn(nnz, vocab, generator=g) * 3  # the student's, packed: every position
    teacher_logits = torch.randn(nnz, vocab, generator=g) * 3
    t_logp_all, t_ids_all = torch.log_softmax(teacher_logits, -1).topk(k, dim=-1)
    lens = [int(x) for x in data["attention_mask"].sum(-1)]
    splits = lambda t: list(torch.split(t, lens))  # noqa: E731
    out = compute_forward_kl_topk(logits.unsqueeze(0), nested_tensor(splits(t_logp_all), layout=torch.jagged),
                                  nested_tensor(splits(t_ids_all), layout=torch.jagged), dist, "thd")
    model_output = {name: value.squeeze(0) for name, value in out.items()}
    logp_flat = torch.log_softmax(logits, -1).max(-1).values  # any per-token log-prob for the policy-gradient term
    model_output["log_probs"] = logp_flat
    old = torch.zeros(mask.shape)
    valid = where >= 0
    logp = torch.zeros(mask.shape)
    logp[valid] = logp_flat[where[valid]]
    old[valid] = logp[valid] - 0.05
    data["old_log_probs"] = old
    _batch_info(data, mask)
    theirs, their_metrics = verl_losses.distillation_loss(actor, dist, model_output, data)
    # verl_async's side: the teacher's top-k per response token, the student's log-probs at those ids
    t_ids = torch.zeros(*mask.shape, k, dtype=torch.long)
    t_logp = torch.zeros(*mask.shape, k)
    t_ids[valid], t_logp[valid] = t_ids_all[where[valid]], t_logp_all[where[valid]]
    s_logp = torch.zeros(*mask.shape, k)
    s_logp[valid] = topk_log_probs(logits[where[valid]], t_ids[valid])
    ours, metrics = _ours(cfg, logp, old, mask, agg, student_topk_logp=s_logp, teacher_topk_logp=t_logp)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-6)
    assert metrics["teacher_mass"] == pytest.approx(their_metrics["distillation/teacher_mass"], rel=1e-5)
    assert metrics["student_mass"] == pytest.approx(their_metrics["distillation/student_mass"], rel=1e-5)
