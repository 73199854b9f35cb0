"""Ulysses sequence parallelism (verl_async/trainer/ulysses.py) equals one rank holding whole sequences.

Fast part: gloo ranks started with torch.multiprocessing run the tiny model's packed micro-batch
split over sp = 2 and sp = 4 ranks (4 query / 2 KV heads: sp = 4 repeats the KV heads) and compare
the gathered log-probs, entropy and the parameter gradients (summed over the group) with the
unsplit forward of the same row. Slow part: the FSDP2 worker group with sp = 2 against one rank:
log-probs, loss, grad norm and the weights after a training step.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from trainer_helpers import make_batch, with_advantages

from verl_async.trainer.ulysses import SPGroup, slice_packed


def test_slice_packed_pads_with_a_sequence_of_its_own_and_labels_the_next_token():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    parts = [slice_packed(ids, pos, cu, 3, SPGroup(None, 4, r), pad_token_id=0) for r in range(4)]
    assert [p.input_ids.tolist() for p in parts] == [[[5, 6]], [[7, 8]], [[9, 0]], [[0, 0]]]
    assert [p.position_ids.tolist() for p in parts] == [[[0, 1]], [[2, 0]], [[1, 0]], [[1, 2]]]
    assert [p.labels.tolist() for p in parts] == [[[6, 7]], [[8, 9]], [[0, 0]], [[0, 5]]]
    assert parts[0].varlen_kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5, 8] and parts[0].length == 8
    assert parts[0].varlen_kwargs["max_length_q"] == 3
    exact = slice_packed(ids[:, :4], pos[:, :4], torch.tensor([0, 3, 4], dtype=torch.int32), 3, SPGroup(None, 2, 1),
                         pad_token_id=0)
    assert exact.input_ids.tolist() == [[7, 8]] and exact.varlen_kwargs["cu_seq_lens_q"].tolist() == [0, 3, 4]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _packed_inputs(vocab: int):
    from verl_async.trainer.batching import build_model_inputs

    batch = make_batch(groups=3, n=2, seed=7, vocab=vocab, prompt_len=(2, 9), response_len=(1, 12))
    rows = list(range(batch.batch_size[0]))
    return build_model_inputs(batch, rows, packed=True, pad_token_id=0, with_varlen_kwargs=True)


def _load(model_dir: str, attn: str):
    from verl_async.models.loading import load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(model_dir, dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False
    return model


def _rank(rank: int, sp: int, port: int, model_dir: str, out_dir: str) -> None:
    """One rank: the split forward and its gradient; rank 0 also the unsplit reference."""
    from verl_async.algos import logprobs_and_entropy
    from verl_async.trainer.attention import resolve_attn_implementation
    from verl_async.trainer.ulysses import (build_sp_group, gather_sequence, register_ulysses_attention,
                                            sequence_parallel)

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=sp)
    try:
        group = build_sp_group(sp, rank, sp)
        model = _load(model_dir, register_ulysses_attention(resolve_attn_implementation("varlen", "cpu")))
        inp = _packed_inputs(model.config.vocab_size)
        weight = torch.linspace(-1.0, 1.0, inp.labels.shape[1]).unsqueeze(0)
        piece = slice_packed(inp.input_ids, inp.position_ids, inp.varlen_kwargs["cu_seq_lens_q"],
                             inp.varlen_kwargs["max_length_q"], group, pad_token_id=0)
        with sequence_parallel(group):
            logits = model(input_ids=piece.input_ids, position_ids=piece.position_ids, attention_mask=None,
                           use_cache=False, **piece.varlen_kwargs).logits
        logp, ent = logprobs_and_entropy(logits, piece.labels, 1.0)
        logp = gather_sequence(logp, group)[:, inp.logits_index]
        ent = gather_sequence(ent, group)[:, inp.logits_index]
        ((logp * weight).sum() + 0.1 * ent.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)  # the group's gradients add up to the full one
        if rank == 0:
            torch.save({"logp": logp.detach(), "ent": ent.detach(), "grads": grads}, os.path.join(out_dir, "sp.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # each rank is a process that imports torch and transformers (~20 s apiece on 2 busy cores)
@pytest.mark.parametrize("sp", [2, 4])
def test_split_forward_and_gradient_equal_the_whole_sequence(sp, tiny_model_dir, tmp_path):
    from verl_async.algos import logprobs_and_entropy
    from verl_async.trainer.attention import resolve_attn_implementation

    mp.spawn(_rank, args=(sp, _free_port(), tiny_model_dir, str(tmp_path)), nprocs=sp, join=True)
    got = torch.load(tmp_path / "sp.pt")
    model = _load(tiny_model_dir, resolve_attn_implementation("varlen", "cpu"))
    inp = _packed_inputs(model.config.vocab_size)
    logits = model(**inp.model_kwargs()).logits
    logp, ent = logprobs_and_entropy(logits, inp.labels, 1.0)
    weight = torch.linspace(-1.0, 1.0, inp.labels.shape[1]).unsqueeze(0)
    ((logp * weight).sum() + 0.1 * ent.sum()).backward()
    torch.testing.assert_close(got["logp"], logp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["ent"], ent.detach(), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------- the FSDP2 worker group
def _group(model_dir: str, world: int, sp: int, name: str):
    from trainer_helpers import compose_config

    from verl_async.trainer import FSDPWorkerGroup

    a = "actor_rollout_ref.actor"
    cfg = compose_config(model_dir, f"trainer.n_gpus_per_node={world}", "actor_rollout_ref.rollout.n=2",
                         f"{a}.ppo_mini_batch_size=2", f"{a}.ulysses_sequence_parallel_size={sp}",
                         f"{a}.use_kl_loss=true", f"{a}.kl_loss_coef=0.1", f"{a}.entropy_coeff=0.01",
                         f"{a}.grad_clip=100.0", f"{a}.ppo_max_token_len_per_gpu={24 // sp}",
                         f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={24 // sp}",
                         f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={24 // sp}",
                         f"{a}.optim.lr=0.05", f"{a}.optim.eps=1.0", "trainer.worker_timeout_s=180")
    return FSDPWorkerGroup(cfg, name=name)


@pytest.mark.slow
def test_fsdp_group_with_sp2_equals_one_rank(ray_session, tiny_model_dir):
    """Two ranks splitting every sequence (sp = 2, one data-parallel share) train as one rank holding them:
    the same log-probs and entropy, loss terms, grad norm and weights after two optimizer steps; both ranks of
    the group report data-parallel rank 0. The token budget of a micro-batch is sp x the per-device one."""
    from concurrent.futures import ThreadPoolExecutor

    from verl_async.sync.object_store import full_weights

    groups = {sp: _group(tiny_model_dir, sp, sp, f"ulysses_sp{sp}") for sp in (2, 1)}
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = dict(zip(groups, pool.map(lambda g: g.init(), groups.values())))
        assert [i["dp_rank"] for i in infos[2]] == [0, 0] and groups[2].dp_size == 1
        assert {i["attn_implementation"] for i in infos[2]} == {"ulysses"}
        batch = with_advantages(make_batch(groups=4, n=2, seed=11), seed=3)
        runs = {}
        for sp, g in groups.items():
            logp, ent = g.compute_log_prob(batch, calculate_entropy=True)
            batch["old_log_probs"] = batch["rollout_log_probs"]
            batch["ref_log_prob"] = g.compute_ref_log_prob(batch)
            runs[sp] = (logp, ent, g.update(batch), dict(full_weights(g, bucket_bytes=1 << 20)))
        (lp2, ent2, m2, w2), (lp1, ent1, m1, w1) = runs[2], runs[1]
        torch.testing.assert_close(lp2, lp1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent2, ent1, rtol=1e-5, atol=1e-5)
        assert m1["actor/optimizer_steps"] == m2["actor/optimizer_steps"] == 2.0
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
        assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-4)
        for k in w1:
            torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    finally:
        for g in groups.values():
            g.shutdown()
