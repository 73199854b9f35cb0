"""Distillation's rollout side and its way into the loss (fast, CPU): the teacher's scores against a plain forward,
batching, routing, the response hook's timing, the batch tensors, the trainer's top-k and loss."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tests.fakes import FakeEngine
from verl_async.algos.distillation import DistillationLoss, distillation_loss
from verl_async.protocol import Response, RolloutSample, collate_groups
from verl_async.queue import MessageQueue
from verl_async.rollout.engine import SamplingParams
from verl_async.rollout.rollouter import PromptTask, Rollouter
from verl_async.staleness import StalenessBudget
from verl_async.teachers.model import TeacherModel, TeacherRequest
from verl_async.teachers.pool import TeacherPool, TeacherReplica, routing_value
from verl_async.utils.replica_plan import ReplicaPlan
from verl_async.trainer.batching import build_model_inputs
from verl_async.trainer.loss import LossConfig, actor_loss, student_topk
from verl_async.utils.microbatch import MicroBatcher, chunks


@pytest.fixture(scope="module")
def teacher(tiny_model_dir):
    return TeacherModel(tiny_model_dir, topk=5, max_num_seqs=2, max_num_batched_tokens=64)


def _reference(model, tokens, start, k):
    with torch.no_grad():
        logits = model.model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits, -1)[start - 1: len(tokens) - 1]
    target = torch.tensor(tokens[start:])
    return logp.gather(-1, target[:, None])[:, 0], logp.topk(k, -1)


def test_teacher_scores_equal_a_plain_forward_whatever_the_batch(teacher):
    requests = [TeacherRequest(tuple(range(3, 3 + n)), s) for n, s in ((9, 4), (5, 1), (12, 7), (6, 6), (7, 2))]
    out = teacher.score(requests)  # left-padded batches of <= 2 sequences / 64 tokens
    for req, got in zip(requests, out):
        logp, (values, ids) = _reference(teacher, list(req.token_ids), req.response_start, 5)
        torch.testing.assert_close(got.log_probs, logp, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got.topk_log_probs, values, atol=2e-5, rtol=1e-5)
        assert torch.equal(got.topk_ids, ids)
        assert got.log_probs.shape == (len(req.token_ids) - req.response_start,)


def test_teacher_refuses_another_vocabulary(teacher):
    with pytest.raises(ValueError, match="outside the teacher's vocabulary"):
        teacher.score([TeacherRequest((1, 2, 10 ** 6), 1)])
    with pytest.raises(ValueError, match="response_start"):
        TeacherRequest((1, 2), 0)


def test_chunks_respect_items_and_padded_tokens():
    assert chunks([2, 3, 3, 5, 9], max_items=2, max_tokens=None) == [[0, 1], [2, 3], [4]]
    assert chunks([2, 3, 3, 5, 9], max_items=8, max_tokens=10) == [[0, 1, 2], [3], [4]]  # 3 x 3, then 5 x 2 > 10


def test_microbatcher_batches_concurrent_callers_and_fails_them_together():
    calls = []

    def fn(items):
        calls.append(list(items))
        if "bad" in items:
            raise RuntimeError("model failed")
        return [x * 2 for x in items]

    async def run():
        b = MicroBatcher(fn, max_items=3, linger_s=0.01)
        first = await asyncio.gather(*(b.submit(i) for i in range(5)))
        failed = await asyncio.gather(b.submit("bad"), b.submit(1), return_exceptions=True)
        return first, failed, b

    first, failed, b = asyncio.run(run())
    assert first == [0, 2, 4, 6, 8] and calls[:2] == [[0, 1, 2], [3, 4]]
    assert all(isinstance(e, RuntimeError) for e in failed)  # one batch: both callers get its error
    assert b.batches == 2 and b.items == 5


def test_pool_routes_rows_by_teacher_key_and_fills_responses(tiny_model_dir, tmp_path):
    from verl_async.models.tiny import build_tiny_model_dir

    other = build_tiny_model_dir(str(tmp_path / "other"), seed=5)
    plan = ReplicaPlan("cpu")
    replicas = {"openai/gsm8k": [TeacherReplica(tiny_model_dir, plan, topk=3)],
                "geo": [TeacherReplica(other, plan, topk=3)]}

    def route(value):
        if value not in replicas:
            raise ValueError(f"No teacher configured for routing key {value!r}.")
        return value

    pool = TeacherPool(replicas, route, "data_source", remote=False)
    items = [PromptTask("a", 0, 0, [5, 6, 7], data_source="openai/gsm8k"),
             PromptTask("b", 1, 0, [5, 6, 7], data_source="", extra_info={"data_source": "geo"})]
    responses = [Response([8, 9, 10], [0.0] * 3, [0] * 3, "stop"), Response([8, 9, 10], [0.0] * 3, [0] * 3, "stop")]

    async def run():
        await asyncio.gather(*(pool.annotate(i, r) for i, r in zip(items, responses)))
        with pytest.raises(ValueError, match="No teacher configured"):
            await pool.annotate(PromptTask("c", 2, 0, [5], data_source="math"), Response([8], [0.0], [0], "stop"))

    asyncio.run(run())
    assert routing_value(items[1], "data_source") == "geo"
    expected = [replicas[k][0].model.score([TeacherRequest((5, 6, 7, 8, 9, 10), 3)])[0] for k in ("openai/gsm8k", "geo")]
    for r, e in zip(responses, expected):
        assert r.teacher_log_probs == pytest.approx(e.log_probs.tolist(), abs=1e-6)
        assert r.teacher_topk_ids == e.topk_ids.tolist() and len(r.teacher_topk_log_probs[0]) == 3
    assert responses[0].teacher_log_probs != pytest.approx(responses[1].teacher_log_probs)  # two teachers
    assert pool.metrics()["distillation/teacher_scored_tokens"] == 6


def test_the_hook_scores_a_response_while_the_others_still_generate():
    seen = []

    async def hook(item, response):
        if any(r is response for _, r, _ in seen):
            return
        seen.append((item.uid, response, time.monotonic()))
        response.teacher_log_probs = [0.0] * len(response)

    async def score(item, responses):
        assert all(r.teacher_log_probs is not None for r in responses)
        return [(0.0, {}) for _ in responses]

    queue = MessageQueue(capacity=8, group_size=3)

    class Sink:
        async def put(self, sample):
            await queue.put(sample)

        async def size(self):
            return queue.size()

    class Source:
        def __init__(self):
            self.items = [PromptTask("p0", 0, 0, [1, 2, 3], extra_info={"target_lengths": [2, 10, 40]})]

        def next(self):
            return self.items.pop() if self.items else None

        def push_front(self, items):
            pass

        def state_dict(self):
            return {}

    ro = Rollouter(engines=[FakeEngine(seed=0, max_len=64, token_delay=0.005)], prompts=Source(), scorer=score,
                   sink=Sink(), n=3, sampling=SamplingParams(max_tokens=64, seed=0, ignore_eos=True),
                   budget=StalenessBudget(4), partial_rollout=True, max_inflight_groups=4, response_hook=hook)
    asyncio.run(ro.run())
    group = asyncio.run(queue.get_batch(1, timeout=1))[0]
    assert len(seen) == 3 and all(r.teacher_log_probs is not None for r in group.responses)
    first_scored = min(t for _, _, t in seen)
    longest = max(group.responses, key=len)
    # the shortest response was scored while the longest still generated (not once the whole group was done)
    assert len(longest) == 40 and first_scored < seen[[r for _, r, _ in seen].index(longest)][2]


def test_teacher_tensors_in_the_batch_and_all_or_none():
    r1 = Response([1, 2], [0.0, 0.0], [0, 0], "stop", teacher_log_probs=[-1.0, -2.0],
                  teacher_topk_ids=[[1, 2], [3, 4]], teacher_topk_log_probs=[[-0.5, -1.0], [-0.2, -3.0]])
    r2 = Response([5], [0.0], [0], "stop", teacher_log_probs=[-0.5], teacher_topk_ids=[[5, 6]],
                  teacher_topk_log_probs=[[-0.1, -4.0]])
    batch = collate_groups([RolloutSample("u", [9], [r1, r2])], pad_token_id=0)
    torch.testing.assert_close(batch["teacher_log_probs"], torch.tensor([[-1.0, -2.0], [-0.5, 0.0]]))
    assert batch["teacher_topk_ids"].shape == (2, 2, 2) and batch["teacher_topk_ids"][1, 1].tolist() == [0, 0]
    with pytest.raises(ValueError, match="teacher log-probs and some do not"):
        collate_groups([RolloutSample("u", [9], [r1, Response([5], [0.0], [0], "stop")])], pad_token_id=0)
    with pytest.raises(ValueError, match="teacher_log_probs"):
        Response([1, 2], [0.0, 0.0], [0, 0], "stop", teacher_log_probs=[-1.0])


@pytest.mark.parametrize("packed", [True, False])
def test_student_topk_in_the_trainer_equals_the_log_softmax_at_the_teachers_ids(packed):
    g = torch.Generator().manual_seed(0)
    responses = [Response([4, 5, 6], [0.0] * 3, [0] * 3, "stop"), Response([7], [0.0], [0], "stop")]
    batch = collate_groups([RolloutSample("u", [1, 2], responses)], pad_token_id=0)
    inp = build_model_inputs(batch, [0, 1], packed=packed, pad_token_id=0)
    vocab = 12
    logits = torch.randn(*inp.labels.shape, vocab, generator=g)
    ids = torch.randint(0, vocab, (2, 3, 4), generator=g)
    out = student_topk(logits, inp, ids, temperature=0.5)
    # the plain way: the log-prob row that predicts each response token, at the teacher's ids
    full = torch.log_softmax(logits.float() / 0.5, -1).reshape(-1, vocab)
    for n, (row, col) in enumerate(zip(inp.dst_row.tolist(), inp.dst_col.tolist())):
        torch.testing.assert_close(out[row, col], full[inp.src[n]][ids[row, col]])
    assert float(out[1, 1:].abs().sum()) == 0.0  # off the response


def test_actor_loss_adds_the_distillation_term_masked():
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])  # a tool token inside the first response
    logp = -torch.rand(2, 3, generator=g)
    data = {"loss_mask": mask, "old_log_probs": logp.clone(), "advantages": torch.randn(2, 3, generator=g),
            "teacher_log_probs": -torch.rand(2, 3, generator=g)}
    base = dict(loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="kl")
    norm = dict(global_tokens=4.0, global_seqs=2.0, loss_scale_factor=3)
    plain, _ = actor_loss(logp, None, data, LossConfig(**base), **norm)
    dist = DistillationLoss(loss_mode="k3", distillation_loss_coef=0.5)
    both, metrics = actor_loss(logp, None, data, LossConfig(**base, distillation=dist), **norm)
    expected, _ = distillation_loss(dist, logp, logp, mask, "token-mean", teacher_logp=data["teacher_log_probs"],
                                    global_tokens=4.0, global_seqs=2.0, loss_scale_factor=3)
    torch.testing.assert_close(both, plain + 0.5 * expected)
    assert metrics["distillation/loss"] == pytest.approx(float(expected))
    # the masked tool token's teacher value changes nothing
    data["teacher_log_probs"][0, 1] = -50.0
    torch.testing.assert_close(actor_loss(logp, None, data, LossConfig(**base, distillation=dist), **norm)[0], both)
