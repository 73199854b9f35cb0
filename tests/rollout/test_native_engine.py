"""Native engine behaviour on the tiny CPU model: exact log-probs, abort/continue, refit, bad input."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch

from verl_async.models.loading import load_causal_lm
from verl_async.rollout.engine import GenerateRequest, SamplingParams
from verl_async.rollout.native import NativeEngine, WeightUpdateError
from verl_async.rollout.registry import build_engine, build_engine_from_config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir, attn_implementation="sdpa").eval().requires_grad_(False)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=90))


def req(rid, prompt, **sampling) -> GenerateRequest:
    return GenerateRequest(rid, list(prompt), SamplingParams(**sampling))


async def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.002)


def recompute(model, prompt, response, temperature):
    """The trainer's recomputation: one full forward, log_softmax(logits / T)[token]."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


PROMPTS = [[5, 9, 30, 41, 7], [100, 3], [17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27], [250], [64, 65, 66, 67]]


def test_log_probs_match_trainer_forward(tiny_model):
    temps = [1.0, 0.7, 0.0, 1.3, 0.9, 1.0]
    extra = [{}, {"top_k": 20}, {}, {"top_p": 0.9}, {"top_k": 7, "top_p": 0.8}, {"seed": 3}]
    max_tokens = [9, 23, 14, 31, 6, 17]

    async def main():
        eng = NativeEngine(model=tiny_model, max_num_seqs=3, max_model_len=64)  # 6 requests, 3 slots: join/leave
        try:
            reqs = [
                req(f"r{i}", PROMPTS[i % len(PROMPTS)], temperature=t, max_tokens=m, ignore_eos=True, **e)
                for i, (t, m, e) in enumerate(zip(temps, max_tokens, extra))
            ]
            return await asyncio.gather(*[eng.generate(r) for r in reqs]), reqs
        finally:
            await eng.shutdown()

    results, reqs = run(main())
    worst = 0.0
    for res, r in zip(results, reqs):
        assert res.ok and res.finish_reason == "length" and len(res.token_ids) == r.sampling.max_tokens
        assert res.versions == [0] * len(res.token_ids)
        ref = recompute(tiny_model, r.prompt_ids, res.token_ids, r.sampling.temperature)
        worst = max(worst, (ref - torch.tensor(res.log_probs)).abs().max().item())
    assert worst < 1e-4, worst

    # a padded batch recomputation (what a trainer micro-batch does) agrees as well
    seqs = [r.prompt_ids + res.token_ids for r, res in zip(reqs, results)]
    width = max(map(len, seqs))
    for left in (False, True):
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(seqs):
            cols = slice(width - len(s), width) if left else slice(0, len(s))
            ids[row, cols], mask[row, cols] = torch.tensor(s), 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = tiny_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        for row, (r, res) in enumerate(zip(reqs, results)):
            start = (width - len(seqs[row]) if left else 0) + len(r.prompt_ids) - 1
            t = r.sampling.temperature or 1.0
            lp = torch.log_softmax(logits[row, start : start + len(res.token_ids)] / t, -1)
            got = lp.gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0]
            assert (got - torch.tensor(res.log_probs)).abs().max().item() < 1e-4


def test_abort_then_continue_reproduces_greedy(tiny_model):
    prompt, budget = PROMPTS[0], 60
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}

    async def main():
        eng = NativeEngine(model=tiny_model, max_num_seqs=2, max_model_len=96)
        try:
            ref = await eng.generate(req("ref", prompt, temperature=0.0, max_tokens=budget, ignore_eos=True))
            task = asyncio.create_task(eng.generate(req("x", prompt, temperature=0.0, max_tokens=budget, ignore_eos=True)))
            await wait_until(lambda: eng.progress("x") >= 4)
            await eng.abort(["x"])
            part = await task
            # same weights under a new version: old tokens keep 0, new ones get 7
            await eng.update_weights(iter(state.items()), version=7)
            cont = GenerateRequest(
                "x",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=budget, ignore_eos=True),
                prefix_token_ids=part.token_ids,
                prefix_log_probs=part.log_probs,
                prefix_versions=part.versions,
            )
            return ref, part, await eng.generate(cont)
        finally:
            await eng.shutdown()

    ref, part, full = run(main())
    assert part.finish_reason == "abort" and part.ok
    k = len(part.token_ids)
    assert 4 <= k < budget and part.token_ids == ref.token_ids[:k]
    assert full.finish_reason == "length" and full.token_ids == ref.token_ids
    assert full.versions == [0] * k + [7] * (budget - k)
    assert full.log_probs[:k] == part.log_probs
    assert max(abs(a - b) for a, b in zip(full.log_probs, ref.log_probs)) < 1e-4


def test_abort_waiting_and_all(tiny_model):
    async def main():
        eng = NativeEngine(model=tiny_model, max_num_seqs=1, max_model_len=512)
        try:
            first = asyncio.create_task(eng.generate(req("a", [1, 2], max_tokens=400, ignore_eos=True)))
            second = asyncio.create_task(eng.generate(req("b", [3, 4], max_tokens=400, ignore_eos=True)))
            await wait_until(lambda: eng.progress("a") >= 2 and eng.stats().waiting == 1)
            await eng.abort()  # all
            return await first, await second, eng.stats()
        finally:
            await eng.shutdown()

    a, b, stats = run(main())
    assert a.finish_reason == b.finish_reason == "abort"
    assert len(a.token_ids) >= 2 and b.token_ids == [] and a.ok and b.ok
    assert stats.running == stats.waiting == 0


def perturbed_state(model, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {
        name: p + scale * torch.randn(p.shape, generator=g) for name, p in model.named_parameters()
    }


def test_refit_changes_outputs_and_bumps_version(tiny_model):
    model = copy.deepcopy(tiny_model)
    new_state = perturbed_state(model)
    reference = copy.deepcopy(tiny_model)
    reference.load_state_dict(new_state, strict=False)

    async def main():
        eng = NativeEngine(model=model, max_num_seqs=4, max_model_len=64)
        try:
            r = req("g", PROMPTS[2], temperature=0.0, max_tokens=20, ignore_eos=True)
            before = await eng.generate(r)
            names = list(new_state)
            buckets = [{n: new_state[n] for n in names[i : i + 5]} for i in range(0, len(names), 5)]
            buckets.append(("lm_head.weight", new_state["model.embed_tokens.weight"]))  # tied alias
            await eng.update_weights(iter(buckets), version=3)
            after = await eng.generate(r)
            sampled = await eng.generate(req("s", PROMPTS[1], temperature=0.8, max_tokens=12, ignore_eos=True))
            return before, after, sampled, eng.stats()
        finally:
            await eng.shutdown()

    before, after, sampled, stats = run(main())
    assert before.versions == [0] * 20 and after.versions == [3] * 20 and stats.version == 3
    assert before.token_ids != after.token_ids
    for res, prompt, t in ((after, PROMPTS[2], 0.0), (sampled, PROMPTS[1], 0.8)):
        ref = recompute(reference, prompt, res.token_ids, t)
        assert (ref - torch.tensor(res.log_probs)).abs().max().item() < 1e-4


def test_bad_weights_are_rejected_and_serving_continues(tiny_model):
    model = copy.deepcopy(tiny_model)
    q_name = "model.layers.0.self_attn.q_proj.weight"
    original = model.get_parameter(q_name).clone()

    async def main():
        eng = NativeEngine(model=model, max_num_seqs=4, max_model_len=256)
        try:
            good = [asyncio.create_task(eng.generate(req(f"g{i}", PROMPTS[i], max_tokens=120, ignore_eos=True))) for i in range(3)]
            await wait_until(lambda: eng.stats().running == 3)
            errors = []
            bad_streams = [
                [{q_name: torch.zeros_like(original), "model.layers.0.no_such.weight": torch.zeros(3)}],
                [{q_name: torch.zeros_like(original), "model.norm.weight": torch.zeros(7)}],
                [(q_name, torch.full_like(original, float("nan")))],
                ["not a pair"],
            ]
            for stream in bad_streams:
                with pytest.raises(WeightUpdateError) as info:
                    await eng.update_weights(iter(stream), version=9)
                errors.append(str(info.value))
            # a later bad bucket: the error says the earlier one was applied
            with pytest.raises(WeightUpdateError, match="1 tensor"):
                await eng.update_weights(iter([{q_name: original + 0}, {"bogus": original}]), version=9)
            return [await t for t in good], errors, eng.version
        finally:
            await eng.shutdown()

    results, errors, version = run(main())
    assert "no_such" in errors[0] and "unknown weight name" in errors[0] and "nothing of this update" in errors[0]
    assert "model.norm.weight" in errors[1] and "(7,)" in errors[1]
    assert "NaN" in errors[2] and q_name in errors[2]
    assert "item 0" in errors[3]
    assert torch.equal(model.get_parameter(q_name), original)  # the bad buckets changed nothing
    assert version == 0
    assert all(r.ok and r.finish_reason == "length" and len(r.token_ids) == 120 for r in results)


def test_concurrent_finish_reasons(tiny_model):
    async def main():
        eng = NativeEngine(model=tiny_model, max_num_seqs=8, max_model_len=40)
        try:
            ref = await eng.generate(req("ref", PROMPTS[0], temperature=0.0, max_tokens=30, ignore_eos=True))
            stop_tok = ref.token_ids[6]
            cut = ref.token_ids.index(stop_tok) + 1
            eng.eos_token_ids = frozenset({stop_tok})  # EOS hit later -> "stop"
            jobs = {
                "stop_id": req("stop_id", PROMPTS[0], temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=(stop_tok,)),
                "eos": req("eos", PROMPTS[0], temperature=0.0, max_tokens=30),
                "eos_ignored": req("eos_ignored", PROMPTS[0], temperature=0.0, max_tokens=30, ignore_eos=True),
                "len3": req("len3", PROMPTS[1], max_tokens=3, ignore_eos=True),
                "len1": req("len1", PROMPTS[3], max_tokens=1, ignore_eos=True),
                "ctx": req("ctx", PROMPTS[2], max_tokens=100, ignore_eos=True),  # 11 + 29 = max_model_len 40
                "sampled": req("sampled", PROMPTS[4], temperature=1.0, max_tokens=17, ignore_eos=True),
            }
            out = await asyncio.gather(*[eng.generate(r) for r in jobs.values()])
            return ref, cut, dict(zip(jobs, out))
        finally:
            await eng.shutdown()

    ref, cut, out = run(main())
    assert all(r.ok for r in out.values())
    assert out["stop_id"].finish_reason == "stop" and out["stop_id"].token_ids == ref.token_ids[:cut]
    assert out["eos"].finish_reason == "stop" and out["eos"].token_ids == ref.token_ids[:cut]
    assert out["eos_ignored"].finish_reason == "length" and out["eos_ignored"].token_ids == ref.token_ids
    assert out["len3"].finish_reason == "length" and len(out["len3"].token_ids) == 3
    assert out["len1"].finish_reason == "length" and len(out["len1"].token_ids) == 1
    assert out["ctx"].finish_reason == "length" and len(out["ctx"].token_ids) == 40 - len(PROMPTS[2])
    assert out["sampled"].finish_reason == "length" and len(out["sampled"].token_ids) == 17


def test_bad_requests_get_errors_while_good_ones_run(tiny_model):
    async def main():
        eng = NativeEngine(model=tiny_model, max_num_seqs=4, max_model_len=32)
        vocab = eng.vocab_size
        try:
            good = [asyncio.create_task(eng.generate(req(f"ok{i}", PROMPTS[i], max_tokens=15, ignore_eos=True))) for i in range(2)]
            bad = {
                "too_long": req("too_long", list(range(1, 33)), max_tokens=4),
                "zero_budget": req("zero_budget", [1, 2], max_tokens=0),
                "stop_oov": req("stop_oov", [1, 2], max_tokens=4, stop_token_ids=(vocab + 5,)),
                "prompt_oov": req("prompt_oov", [1, vocab], max_tokens=4),
                "empty": req("empty", [], max_tokens=4),
                "bad_top_p": req("bad_top_p", [1], max_tokens=4, top_p=0.0),
                "prefix_mismatch": GenerateRequest("prefix_mismatch", [1, 2], SamplingParams(max_tokens=4), prefix_token_ids=[3], prefix_log_probs=[]),
                "dup": req("ok0", [1, 2], max_tokens=4),
            }
            bad_out = await asyncio.gather(*[eng.generate(r) for r in bad.values()])
            return [await t for t in good], dict(zip(bad, bad_out))
        finally:
            await eng.shutdown()

    good, bad = run(main())
    assert all(r.ok and len(r.token_ids) == 15 for r in good)
    expect = {
        "too_long": "max_model_len",
        "zero_budget": "max_tokens",
        "stop_oov": "stop_token_ids",
        "prompt_oov": "prompt_ids",
        "empty": "empty",
        "bad_top_p": "top_p",
        "prefix_mismatch": "prefix_log_probs",
        "dup": "already in flight",
    }
    for key, needle in expect.items():
        res = bad[key]
        assert not res.ok and res.finish_reason == "abort" and needle in res.error, (key, res.error)


def test_kv_budget_admission(tiny_model):
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        NativeEngine(model=tiny_model, max_model_len=64, kv_cache_tokens=32).close()

    async def main():
        eng = NativeEngine(model=tiny_model, max_num_seqs=8, max_model_len=64, kv_cache_tokens=2 * 64 + 10)
        try:
            assert eng.num_slots == 2 and eng.stats().kv_budget_tokens == 128
            tasks = [asyncio.create_task(eng.generate(req(f"k{i}", PROMPTS[i % 5], max_tokens=20 + i, ignore_eos=True))) for i in range(6)]
            seen_waiting = 0
            while not all(t.done() for t in tasks):
                s = eng.stats()
                assert s.running <= 2 and s.kv_used_tokens <= s.kv_budget_tokens
                seen_waiting = max(seen_waiting, s.waiting)
                await asyncio.sleep(0.001)
            return [t.result() for t in tasks], seen_waiting, eng.profile()
        finally:
            await eng.shutdown()

    results, seen_waiting, prof = run(main())
    assert seen_waiting >= 1 and prof["peak_running"] == 2
    assert prof["graphs"] == 0 and prof["graph_capture_s"] == 0.0  # CPU: no CUDA decode graphs to capture
    assert [len(r.token_ids) for r in results] == [20 + i for i in range(6)]


def test_pause_resume_and_seed_independence(tiny_model):
    async def main():
        eng = NativeEngine(model=tiny_model, max_num_seqs=4, max_model_len=64)
        try:
            alone = await eng.generate(req("s", PROMPTS[0], temperature=1.0, seed=11, max_tokens=25, ignore_eos=True))
            await eng.pause()
            tasks = [
                asyncio.create_task(eng.generate(req(f"o{i}", PROMPTS[i], temperature=1.0, max_tokens=10 + 7 * i, ignore_eos=True)))
                for i in range(3)
            ] + [asyncio.create_task(eng.generate(req("s", PROMPTS[0], temperature=1.0, seed=11, max_tokens=25, ignore_eos=True)))]
            await asyncio.sleep(0.2)
            paused_stats = eng.stats()
            await eng.resume()
            results = await asyncio.gather(*tasks)
            return alone, results, paused_stats
        finally:
            await eng.shutdown()

    alone, results, paused_stats = run(main())
    assert paused_stats.paused and paused_stats.waiting == 4 and paused_stats.generated_tokens == 25
    assert results[-1].token_ids == alone.token_ids and results[-1].log_probs == pytest.approx(alone.log_probs, abs=1e-5)


def test_failing_step_fails_its_requests_only(tiny_model):
    async def main():
        eng = NativeEngine(model=tiny_model, max_num_seqs=4, max_model_len=64)
        try:
            real_decode = eng._runner.decode
            calls = {"n": 0}

            def flaky(*args):
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("injected device error")
                return real_decode(*args)

            eng._runner.decode = flaky
            hit = await asyncio.gather(*[eng.generate(req(f"h{i}", PROMPTS[i], max_tokens=10, ignore_eos=True)) for i in range(2)])
            after = await eng.generate(req("later", PROMPTS[2], max_tokens=10, ignore_eos=True))
            return hit, after
        finally:
            await eng.shutdown()

    hit, after = run(main())
    for r in hit:
        assert not r.ok and "injected device error" in r.error and r.finish_reason == "abort"
        assert 1 <= len(r.token_ids) < 10 and len(r.log_probs) == len(r.versions) == len(r.token_ids)
    assert after.ok and len(after.token_ids) == 10


def test_shutdown_and_registry(tiny_model, tiny_model_dir):
    async def main():
        eng = build_engine("native", model=tiny_model, max_num_seqs=2, max_model_len=512)
        task = asyncio.create_task(eng.generate(req("long", [1, 2, 3], max_tokens=500, ignore_eos=True)))
        await wait_until(lambda: eng.progress("long") >= 1)
        await eng.shutdown()
        return await task, await eng.generate(req("late", [1], max_tokens=2))

    cut, late = run(main())
    assert cut.finish_reason == "abort" and "shut down" in cut.error and len(cut.token_ids) >= 1
    assert not late.ok and "shut down" in late.error

    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.name"):
        build_engine("no_such_engine")
    cfg = {
        "name": "native",
        "prompt_length": 16,
        "response_length": 16,
        "max_num_seqs": 3,
        "max_model_len": None,
        "enforce_eager": True,
        "engine_kwargs": {"native": {"kv_len_bucket": 64}},
    }
    eng = build_engine_from_config(cfg, model_path=tiny_model_dir)
    try:
        assert eng.max_model_len == 32 and eng.num_slots == 3
        res = run(eng.generate(req("c", [1, 2], max_tokens=4, ignore_eos=True)))
        assert res.ok and len(res.token_ids) == 4
    finally:
        eng.close()


@pytest.mark.parametrize(
    "attn,override",
    [
        ("eager", None),
        ("sdpa", {"use_sliding_window": True, "sliding_window": 6, "layer_types": ["full_attention", "sliding_attention"]}),
    ],
)
def test_eager_attention_and_sliding_window_match(tiny_model_dir, attn, override):
    model = load_causal_lm(tiny_model_dir, attn_implementation=attn, override_config=override).eval()

    async def main():
        eng = NativeEngine(model=model, max_num_seqs=2, max_model_len=48)
        try:
            reqs = [req(f"v{i}", PROMPTS[i], temperature=0.8, max_tokens=12 + 5 * i, ignore_eos=True) for i in range(3)]
            return reqs, await asyncio.gather(*[eng.generate(r) for r in reqs])
        finally:
            await eng.shutdown()

    reqs, results = run(main())
    for r, res in zip(reqs, results):
        ref = recompute(model, r.prompt_ids, res.token_ids, 0.8)
        assert (ref - torch.tensor(res.log_probs)).abs().max().item() < 1e-4


def test_nan_logits_fail_requests_and_engine_recovers(tiny_model):
    model = copy.deepcopy(tiny_model)
    norm = model.get_parameter("model.norm.weight")
    good = norm.clone()

    async def main():
        eng = NativeEngine(model=model, max_num_seqs=2, max_model_len=64, check_finite_weights=False)
        try:
            await eng.update_weights(iter([("model.norm.weight", torch.full_like(good, float("nan")))]), version=1)
            broken = await eng.generate(req("nan", PROMPTS[0], max_tokens=5))
            await eng.update_weights(iter([("model.norm.weight", good)]), version=2)
            fixed = await eng.generate(req("ok", PROMPTS[0], max_tokens=5, ignore_eos=True))
            return broken, fixed
        finally:
            await eng.shutdown()

    broken, fixed = run(main())
    assert not broken.ok and "NaN" in broken.error and broken.token_ids == []
    assert fixed.ok and fixed.versions == [2] * 5


def test_refit_mid_flight_and_cancelled_caller(tiny_model):
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}

    async def main():
        eng = NativeEngine(model=tiny_model, max_num_seqs=2, max_model_len=512)
        try:
            running = asyncio.create_task(eng.generate(req("m", [1, 2, 3], max_tokens=300, ignore_eos=True)))
            doomed = asyncio.create_task(eng.generate(req("c", [4, 5], max_tokens=400, ignore_eos=True)))
            await wait_until(lambda: eng.progress("m") >= 3 and eng.progress("c") >= 1)
            await eng.update_weights(iter(state.items()), version=5)  # not paused: applies between two steps
            doomed.cancel()  # a caller that goes away aborts its request
            await wait_until(lambda: eng.progress("c") == -1)
            return await running, eng.stats()
        finally:
            await eng.shutdown()

    res, stats = run(main())
    k = res.versions.index(5)
    assert 3 <= k < 300 and res.versions == [0] * k + [5] * (300 - k)
    assert stats.running <= 1
