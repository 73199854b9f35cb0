"""Reward managers: naive / dapo shaping, config errors, custom scorers, the time-bounded sandbox."""

from __future__ import annotations

import textwrap
import time

import pytest
from omegaconf import OmegaConf

from verl_async.data import builtin
from verl_async.models.tiny import build_char_tokenizer
from verl_async.protocol import Response, RolloutSample
from verl_async.reward import OverlongBuffer, RewardManager, UnknownDataSourceError, build_reward_manager
from verl_async.reward.registry import FunctionRef
from verl_async.reward.sandbox import ScorerPool, Task

INFO = {"word": "ab", "times": 5}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids(tok, text: str, eos: bool = True) -> list[int]:
    out = tok(text, add_special_tokens=False)["input_ids"]
    return out + [tok.eos_token_id] if eos else out


@pytest.mark.parametrize(
    "length,factor,expected",
    [(10, 1.0, 0.0), (16, 1.0, 0.0), (17, 1.0, -0.25), (18, 1.0, -0.5), (20, 1.0, -1.0), (24, 1.0, -2.0),
     (18, 0.5, -0.25), (20, 2.0, -2.0)],
)
def test_dapo_overlong_penalty_by_hand(length, factor, expected):
    # max_resp_len 20, buffer 4: expected length 16; the penalty grows 1/4 per token past it
    buf = OverlongBuffer(buffer_len=4, penalty_factor=factor, max_resp_len=20)
    assert buf.penalty(length) == pytest.approx(expected)


def test_dapo_manager_from_003_style_config(tok):
    cfg = OmegaConf.create(
        {
            "reward_manager": "dapo",
            "timeout_s": 5.0,
            "num_workers": 1,
            "reward_kwargs": {
                "overlong_buffer_cfg": {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True},
                "max_resp_len": 12,
            },
        }
    )
    manager = build_reward_manager(cfg, OmegaConf.create({"path": None, "name": "compute_score"}), tok)
    try:
        responses = [ids(tok, "ababababab"), ids(tok, "abab"), ids(tok, "ababababab" + "  ")]
        out = manager.score_group(responses, builtin.DATA_SOURCE, "ababababab", INFO)
        # lengths 11, 5, 13 tokens (EOS included); expected length 12 - 4 = 8
        assert [r.reward for r in out] == pytest.approx([1.0 - 0.75, 0.2, 1.0 - 1.25])
        assert out[0].info["score"] == 1.0 and out[0].info["acc"] == 1.0
        assert out[0].info["overlong_reward"] == pytest.approx(-0.75) and out[0].info["overlong"] == 1.0
        assert out[1].info["overlong"] == 0.0 and out[1].info["reward_error"] == 0.0
        assert manager.metrics() == {"reward/scored": 3.0, "reward/scorer_errors": 0.0, "reward/scorer_timeouts": 0.0}
    finally:
        manager.close()


def test_naive_manager_decodes_without_special_tokens_and_fills_samples(tok):
    manager = build_reward_manager({"reward_manager": "naive"}, None, tok)
    sample = RolloutSample(
        uid="0:0",
        prompt_ids=[1, 2],
        responses=[
            Response(token_ids=t, log_probs=[0.0] * len(t), versions=[0] * len(t), finish_reason="stop")
            for t in (ids(tok, "ababababab"), ids(tok, "abab", eos=False), [])
        ],
        data_source=builtin.DATA_SOURCE,
        ground_truth="ababababab",
        extra_info=INFO,
    )
    manager.score_sample(sample)
    assert [r.reward for r in sample.responses] == pytest.approx([1.0, 0.2, 0.0])
    assert set(sample.responses[0].reward_info) == {"score", "acc", "reward_error", "reward_timeout"}
    assert "overlong_reward" not in sample.responses[0].reward_info


def test_naive_manager_gsm8k_inline(tok):
    manager = RewardManager(tok)
    out = manager.score_texts(["... #### 72", "#### 71", ""], [5, 5, 0], "openai/gsm8k", "72")
    assert [r.reward for r in out] == [1.0, 0.0, 0.0]
    assert manager.pool._workers == []  # bounded scorers never start the sandbox


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"reward_manager": "prime"}, "reward_model.reward_manager='prime'"),
        ({"reward_manager": "naive", "timeout_s": 0}, "reward_model.timeout_s"),
        ({"reward_manager": "naive", "num_workers": 0}, "reward_model.num_workers"),
        (
            {"reward_manager": "naive", "reward_kwargs": {"overlong_buffer_cfg": {"enable": True, "len": 4}, "max_resp_len": 8}},
            "needs reward_model.reward_manager=dapo",
        ),
        (
            {"reward_manager": "dapo", "reward_kwargs": {"overlong_buffer_cfg": {"enable": True, "len": 4}}},
            "reward_model.reward_kwargs.max_resp_len is required",
        ),
        (
            {"reward_manager": "dapo", "reward_kwargs": {"overlong_buffer_cfg": {"enable": True, "len": 16}, "max_resp_len": 8}},
            "max_resp_len \\(8\\) must be >= overlong_buffer_cfg.len \\(16\\)",
        ),
        (
            {"reward_manager": "dapo", "reward_kwargs": {"overlong_buffer_cfg": {"enable": True}, "max_resp_len": 8}},
            "overlong_buffer_cfg.len is required",
        ),
    ],
)
def test_config_errors_name_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_reward_manager(cfg, None, None)


def test_max_resp_len_falls_back_to_data_max_response_length():
    cfg = {"reward_manager": "dapo", "reward_kwargs": {"overlong_buffer_cfg": {"enable": True, "len": 4}}}
    manager = build_reward_manager(cfg, None, None, max_response_length=64)
    assert manager.overlong == OverlongBuffer(buffer_len=4, penalty_factor=1.0, max_resp_len=64)


def test_unknown_data_source_is_an_error_not_a_zero(tok):
    manager = RewardManager(tok)
    with pytest.raises(UnknownDataSourceError, match="data_source='nope'"):
        manager.score_texts(["x"], [1], "nope", "y")


def _write(tmp_path, body: str):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_custom_scorer_config_errors(tmp_path):
    path = _write(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path='/no/such.py'"):
        build_reward_manager({}, {"path": "/no/such.py", "name": "compute_score"}, None)
    with pytest.raises(AttributeError, match="custom_reward_function.name='other'"):
        build_reward_manager({}, {"path": path, "name": "other"}, None)
    with pytest.raises(ValueError, match="custom_reward_function.name is missing"):
        build_reward_manager({}, {"path": path, "name": None}, None)
    broken = tmp_path / "broken.py"
    broken.write_text("this is not python\n")
    with pytest.raises(ImportError, match="custom_reward_function.path"):
        build_reward_manager({}, {"path": str(broken), "name": "compute_score"}, None)


@pytest.fixture(scope="module")
def custom_manager(tmp_path_factory):
    """One sandboxed custom scorer with well-behaved and pathological branches (1 s limit)."""
    path = tmp_path_factory.mktemp("custom") / "scorer.py"
    path.write_text(
        textwrap.dedent(
            """
            import os, re, time

            def my_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
                if solution_str == "raise":
                    raise RuntimeError("scorer bug")
                if solution_str == "catastrophic":  # exponential backtracking: never returns
                    return float(re.match(r"(a+)+$", "a" * 64 + "b") is not None)
                if solution_str == "sleep":
                    time.sleep(60)
                if solution_str == "die":
                    os._exit(3)
                if solution_str == "garbage":
                    return "not a number"
                return {"score": float(solution_str == ground_truth) + bonus, "acc": float(solution_str == ground_truth), "pred": solution_str}
            """
        )
    )
    manager = build_reward_manager(
        {"reward_manager": "naive", "timeout_s": 1.0, "num_workers": 2},
        {"path": str(path), "name": "my_score", "reward_kwargs": {"bonus": 0.5}},
        None,
    )
    yield manager
    manager.close()


def test_custom_scorer_used_for_every_source(custom_manager):
    out = custom_manager.score_texts(["42", "41"], [2, 2], "anything/at_all", "42")
    assert [r.reward for r in out] == [1.5, 0.5]
    assert out[0].info == {"score": 1.5, "acc": 1.0, "reward_error": 0.0, "reward_timeout": 0.0}


def test_raising_and_garbage_scorers_score_zero_and_are_counted(custom_manager):
    before = custom_manager.stats.errors
    out = custom_manager.score_texts(["raise", "garbage", "42"], [1, 1, 1], "x", "42")
    assert [r.reward for r in out] == [0.0, 0.0, 1.5]
    assert out[0].info["reward_error"] == 1.0 and out[0].info["reward_timeout"] == 0.0
    assert custom_manager.stats.errors == before + 2


def test_hanging_scorers_time_out_are_killed_and_counted(custom_manager):
    before = custom_manager.metrics()
    t0 = time.monotonic()
    out = custom_manager.score_texts(["catastrophic", "42", "sleep", "41"], [1] * 4, "x", "42")
    elapsed = time.monotonic() - t0
    assert [r.reward for r in out] == [0.0, 1.5, 0.0, 0.5]
    assert out[0].info["reward_timeout"] == 1.0 and out[2].info["reward_timeout"] == 1.0
    after = custom_manager.metrics()
    assert after["reward/scorer_timeouts"] == before["reward/scorer_timeouts"] + 2
    assert after["reward/scorer_errors"] == before["reward/scorer_errors"] + 2
    assert elapsed < 30  # 1 s limits (plus replacement start-up), not the 60 s sleep
    # replaced workers serve the next call
    assert [r.reward for r in custom_manager.score_texts(["42"], [1], "x", "42")] == [1.5]


def test_dead_worker_is_reported_and_replaced(custom_manager):
    out = custom_manager.score_texts(["die", "42"], [1, 1], "x", "42")
    assert out[0].reward == 0.0 and out[0].info["reward_error"] == 1.0 and out[0].info["reward_timeout"] == 0.0
    assert out[1].reward == 1.5
    assert custom_manager.score_texts(["42"], [1], "x", "42")[0].reward == 1.5


def test_math_scorer_runs_sandboxed_and_survives_10mb_junk(tok):
    manager = RewardManager(tok, timeout_s=20.0)
    try:
        junk = "\\boxed{" + "9{" * 2_500_000 + "}" * 2_500_000 + "}"
        out = manager.score_texts(
            ["$\\boxed{\\frac{7}{12}}$", junk, "x" * 10_000_000], [9, 10, 10], "DigitalLearningGmbH/MATH-lighteval",
            "\\frac{7}{12}",
        )
        assert [r.reward for r in out] == [1.0, 0.0, 0.0]
        assert manager.stats.errors == 0 and len(manager.pool._workers) == 1
    finally:
        manager.close()


def test_pool_runs_plain_function_refs():
    pool = ScorerPool(num_workers=1)
    try:
        ref = FunctionRef(module="verl_async.reward.registry", name="default_compute_score")
        outcomes = pool.run(
            [Task(ref, dict(data_source="openai/gsm8k", solution_str=s, ground_truth="3", extra_info=None))
             for s in ("#### 3", "#### 4")],
            timeout_s=10.0,
        )
        assert [o.value["score"] for o in outcomes] == [1.0, 0.0]
    finally:
        pool.close()


@pytest.mark.slow
def test_sandbox_inside_an_asyncio_ray_actor(ray_session, tmp_path):
    """The deployment shape: a Rollouter-like async actor scoring through asyncio.to_thread."""
    ray = ray_session
    path = tmp_path / "slow_scorer.py"
    path.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'hang':\n"
        "        time.sleep(60)\n"
        "    return float(solution_str == ground_truth)\n"
    )

    @ray.remote(num_cpus=0.1)
    class Scorer:
        def __init__(self, custom_path):
            self.manager = build_reward_manager({"timeout_s": 1.0}, {"path": custom_path, "name": "compute_score"})

        async def score(self, texts):
            import asyncio

            out = await asyncio.to_thread(self.manager.score_texts, texts, [1] * len(texts), "any", "ok")
            return [r.reward for r in out], self.manager.metrics()

    actor = Scorer.remote(str(path))
    rewards, metrics = ray.get(actor.score.remote(["ok", "hang", "no"]), timeout=120)
    assert rewards == [1.0, 0.0, 0.0] and metrics["reward/scorer_timeouts"] == 1.0
    rewards, _ = ray.get(actor.score.remote(["ok"]), timeout=120)
    assert rewards == [1.0]
    ray.kill(actor)


def test_pool_replaces_a_worker_that_died_while_idle():
    pool = ScorerPool(num_workers=1)
    try:
        ref = FunctionRef(module="verl_async.reward.registry", name="default_compute_score")
        task = Task(ref, dict(data_source="openai/gsm8k", solution_str="#### 3", ground_truth="3", extra_info=None))
        assert pool.run([task], timeout_s=10.0)[0].value["score"] == 1.0
        pool._workers[0].proc.kill()
        pool._workers[0].proc.join()
        assert pool.run([task], timeout_s=10.0)[0].value["score"] == 1.0 and pool.replaced == 1
    finally:
        pool.close()
