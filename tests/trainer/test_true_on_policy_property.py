"""True on-policy mode's promise as a property: for ANY batching, the engine's log-prob of every token of
the trainer's version IS the trainer's, bit for bit (issue 41).

Hypothesis draws the run's shape: prompts and `n` responses each (prompt lengths 1-12), how many requests
the engine runs at once (`max_num_seqs` 1-6), each response's length in a first turn, an optional weight
sync after it (a real training step on those tokens, whose first mini-batch must have PPO ratio exactly 1,
micro-batches of a drawn size), multi-turn tool tokens inserted after the first turn (loss mask 0), and a
continuation (a prefill of prompt + prefix, as after an abort) to a drawn length; the trainer recomputes
with drawn micro-batches (any partition of the rows: what any `ppo_max_token_len_per_gpu` or mini-batch
split can produce) packed or padded. Every token sampled by version v equals the trainer's recomputation
under version v. In process, a tiny Llama: CPU float32 here, the same test with `-m gpu` on CUDA (bf16).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("hypothesis")  # the GPU machine needs it carried (docs/true_on_policy.md)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from onpolicy_helpers import TEMPERATURE, batch_of, engine_for, log_probs, rank, run_requests, train_step  # noqa: E402

from verl_async.models.tiny import build_tiny_model_dir  # noqa: E402
from verl_async.rollout.engine import GenerateRequest, GenerateResult, SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(600)

CASES = [pytest.param(("cpu", torch.float32), id="cpu-float32"),
         pytest.param(("cuda", torch.bfloat16), id="cuda-bfloat16", marks=pytest.mark.gpu)]
TOKENS = st.integers(3, 250)


@dataclass
class Scenario:
    prompts: list[list[int]]  # one per row (a prompt repeated n times)
    first: list[int]  # tokens sampled in the first turn
    inserted: list[list[int]]  # tool tokens after the first turn ([]: none)
    second: list[int]  # tokens sampled in the continuation (0: none)
    max_num_seqs: int
    sync: bool  # a training step and a weight sync between the turns
    micro_size: int  # the training step's micro-batch size
    packed: bool
    splits: list[list[list[int]]]  # the trainer's micro-batches for its two recomputations


def _partition(draw, rows: int) -> list[list[int]]:
    order = draw(st.permutations(range(rows)))
    cuts = sorted(draw(st.sets(st.integers(1, rows - 1), max_size=rows - 1))) if rows > 1 else []
    bounds = [0, *cuts, rows]
    return [list(order[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


@st.composite
def scenarios(draw) -> Scenario:
    n_prompts, n = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    prompts = [draw(st.lists(TOKENS, min_size=1, max_size=12)) for _ in range(n_prompts)]
    rows = n_prompts * n
    return Scenario(
        prompts=[prompts[i // n] for i in range(rows)],
        first=[draw(st.integers(1, 8)) for _ in range(rows)],
        inserted=[draw(st.one_of(st.just([]), st.lists(TOKENS, min_size=1, max_size=4))) for _ in range(rows)],
        second=[draw(st.integers(0, 8)) for _ in range(rows)],
        max_num_seqs=draw(st.integers(1, 6)),
        sync=draw(st.booleans()),
        micro_size=draw(st.integers(1, rows)),
        packed=draw(st.booleans()),
        splits=[_partition(draw, rows), _partition(draw, rows)],
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_llama")), family="llama")


class Trainer:
    """One FSDP2 rank for the whole module, and the version its weights are (each sync: + 1)."""

    def __init__(self, model_dir: str, device: str, dtype: torch.dtype):
        self.worker = rank(model_dir, true_on_policy=True, bf16=dtype == torch.bfloat16, device=device)
        self.version, self.dtype = 0, dtype

    def push(self, engine) -> None:
        asyncio.run(engine.update_weights(list(self.worker.iter_full_params(self.dtype)), version=self.version))

    def recompute(self, batch, split, packed: bool) -> torch.Tensor:
        self.worker.set_options({"use_remove_padding": packed})
        return log_probs(self.worker, batch, split)


@pytest.fixture(scope="module", params=CASES)
def trainer(request, model_dir):
    device, dtype = request.param
    t = Trainer(model_dir, device, dtype)
    yield t, model_dir, device
    t.worker.shutdown()


def _requests(sc: Scenario, prefixes=None, masks=None) -> list[GenerateRequest]:
    out = []
    for i, prompt in enumerate(sc.prompts):
        p = prefixes[i] if prefixes else None
        length = len(p.token_ids) + sc.second[i] if p else sc.first[i]
        out.append(GenerateRequest(f"r{i}", list(prompt), SamplingParams(temperature=TEMPERATURE, max_tokens=length,
                                                                          ignore_eos=True, seed=i),
                                   prefix_token_ids=list(p.token_ids) if p else [],
                                   prefix_log_probs=list(p.log_probs) if p else [],
                                   prefix_versions=list(p.versions) if p else []))
    return out


def _with_inserted(r: GenerateResult, ids: list[int]) -> GenerateResult:
    return GenerateResult(r.request_id, r.token_ids + ids, r.log_probs + [0.0] * len(ids),
                          r.versions + [-1] * len(ids), "abort")


def _assert_equal_where(rollout: torch.Tensor, trainer: torch.Tensor, where: torch.Tensor, what: str) -> None:
    gap = (rollout - trainer)[where].abs().max() if where.any() else 0.0
    assert torch.equal(rollout[where], trainer[where]), f"{what}: max gap {gap}"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                               HealthCheck.too_slow])
@given(sc=scenarios())
def test_engine_log_probs_equal_the_trainers_for_any_batching(trainer, sc):
    t, model_dir, device = trainer
    engine = engine_for(model_dir, dtype=t.dtype, true_on_policy=True, max_num_seqs=sc.max_num_seqs, device=device)
    try:
        t.push(engine)
        before_version = t.version
        first = [_with_inserted(r, ids) for r, ids in zip(run_requests(engine, _requests(sc)), sc.inserted)]
        masks = [[1] * (len(r.token_ids) - len(ids)) + [0] * len(ids) for r, ids in zip(first, sc.inserted)]
        batch = batch_of(sc.prompts, first, masks)
        before = t.recompute(batch, sc.splits[0], sc.packed)
        valid = batch["response_mask"].bool()
        assert valid.any()
        _assert_equal_where(batch["rollout_log_probs"], before, valid, "first turn")
        if sc.sync:
            metrics = train_step(t.worker, batch, before, micro_size=sc.micro_size)
            assert metrics["actor/first_minibatch_ratio_dev_max"] == 0.0
            t.version += 1
            t.push(engine)
        final = run_requests(engine, _requests(sc, first))
        masks = [m + [1] * (len(r.token_ids) - len(m)) for m, r in zip(masks, final)]
        batch = batch_of(sc.prompts, final, masks)
        after = t.recompute(batch, sc.splits[1], not sc.packed)
        valid, versions = batch["response_mask"].bool(), batch["token_versions"]
        _assert_equal_where(batch["rollout_log_probs"], after, valid & (versions == t.version), "trainer's version")
        if sc.sync:  # the first turn's tokens, still of the version before
            width = before.shape[1]
            old = (valid & (versions == before_version))[:, :width]
            assert old.any()
            _assert_equal_where(batch["rollout_log_probs"][:, :width], before, old, "the version before the sync")
    finally:
        engine.close()
