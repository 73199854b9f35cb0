"""Multi-turn through the RolloutService (config, dataset, rewards, validation, resume), scripted engine.

The service is built in-process as the pipeline builds it (validated config, the tool-config
YAML, the tokenizer's chat template), with a scripted engine in place of the replicas.
"""

from __future__ import annotations

import asyncio
import textwrap
import time

import pytest

from tests.agent_fakes import ScriptedToolEngine, call
from verl_async.config import compose, validate
from verl_async.data import write_rows
from verl_async.models.loading import load_tokenizer
from verl_async.rollout.service import RolloutService

KEY = "actor_rollout_ref.rollout.multi_turn"

TOOL_MODULE = '''
from verl_async.tools import BaseTool, ToolResponse


class ScoredCalculator(BaseTool):
    """Answers `expression` with its value; a step reward per call and a final reward from calc_reward."""

    async def create(self, instance_id=None, **kwargs):
        self.target = (kwargs.get("create_kwargs") or {}).get("target")
        return "i", ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        import asyncio
        await asyncio.sleep(self.config.get("latency_s", 0))
        return ToolResponse(text=str(eval(parameters["expression"], {}))), 0.25, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 2.0 if self.target == "42" else 0.0
'''

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    info = extra_info or {}
    shaped = sum(info.get("tool_rewards", [])) + sum(info.get("rollout_reward_scores", {}).values())
    return {"score": shaped + 0.01 * info.get("num_turns", 0), "acc": float(str(ground_truth) in solution_str)}
'''


class Remote:
    def __init__(self, fn):
        self.remote = fn


class QueueHandle:
    """The MessageQueue actor's calls the RolloutService makes, in-process."""

    def __init__(self):
        self.groups, self.closed = [], False
        self.put = Remote(self._put)
        self.size = Remote(self._size)
        self.close = Remote(self._close)

    async def _put(self, sample):
        self.groups.append(sample)

    async def _size(self):
        return len(self.groups)

    async def _close(self):
        self.closed = True


def script(uid, i, turn, context):
    if turn == 0:
        return "Let me use the tool. " + call("calculator", expression="6*7")
    later = int(uid.split(":")[1]) if uid.startswith("0:") else 0  # training uids are epoch:index
    pause = " Hm." * (5 * later)  # later prompts write longer second turns: they finish later
    return pause + "The answer is 42." if "<|im_start|>tool\n42<|im_end|>" in context else "no tool answer seen"


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "scored_tools.py").write_text(TOOL_MODULE)
    (tmp_path / "reward.py").write_text(REWARD)
    (tmp_path / "tools.yaml").write_text(textwrap.dedent("""
        tools:
          - class_name: scored_tools.ScoredCalculator
            config: {type: native, latency_s: 0.2}
            tool_schema:
              type: function
              function:
                name: calculator
                description: Evaluate an arithmetic expression.
                parameters:
                  type: object
                  properties: {expression: {type: string, description: the expression}}
                  required: [expression]
    """))
    rows = [{"data_source": "verl_async/arithmetic", "prompt": [{"role": "user", "content": f"What is 6*7? ({k})"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "42"}, "agent_name": "tool_agent",
             "extra_info": {"index": k, "tools_kwargs": {"calculator": {"create_kwargs": {"target": "42"}}}}}
            for k in range(6)]
    write_rows(rows, str(tmp_path / "train.parquet"))
    write_rows(rows[:2], str(tmp_path / "val.parquet"))
    yield tmp_path
    import sys

    sys.modules.pop("scored_tools", None)


def make_service(tmp_path, model_dir, engine, run="run", *extra, custom_reward=True):
    cfg = validate(compose(overrides=[
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/val.parquet", "data.max_prompt_length=256", "data.max_response_length=300",
        "data.shuffle=false", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "async_training.staleness_threshold=10", f"trainer.default_local_dir={tmp_path / run}",
        f"{KEY}.enable=true", f"{KEY}.tool_config_path={tmp_path}/tools.yaml",
        *([f"custom_reward_function.path={tmp_path}/reward.py"] if custom_reward else []), *extra,
    ]))
    handle = QueueHandle()
    svc = RolloutService(cfg, handle, model_path=model_dir, run_dir=str(tmp_path / run), run_start=time.time(),
                         engines=[engine])
    return svc, handle


def test_tool_rewards_and_calc_reward_reach_the_reward_function(setup, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    engine = ScriptedToolEngine(tok, script)
    svc, handle = make_service(setup, tiny_model_dir, engine)
    try:
        assert svc.dataset[0].agent_name == "tool_agent"
        asyncio.run(asyncio.wait_for(svc.run(), 60))
    finally:
        svc.reward.close()
    assert handle.closed and sorted(g.uid for g in handle.groups) == [f"0:{k}" for k in range(6)]
    for group in handle.groups:
        for r in group.responses:
            text = tok.decode(r.token_ids)
            assert text.endswith(" Hm." * 5 * group.index + "The answer is 42.<|im_end|>") and r.loss_mask.count(0) > 0
            # 0.25 step reward + 2.0 from calc_reward + 0.01 * num_turns (4)
            assert r.reward == pytest.approx(2.29) and r.reward_info["acc"] == 1.0
    m = svc.metrics()
    assert m["multi_turn/turns/mean"] == 2.0 and m["multi_turn/tool_call_rate"] == 1.0
    assert m["multi_turn/tool_latency_s/mean"] >= 0.2 and m["multi_turn/trajectories_total"] == 12.0


def test_validation_runs_whole_trajectories(setup, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    svc, _ = make_service(setup, tiny_model_dir, ScriptedToolEngine(tok, script))
    try:
        out = asyncio.run(asyncio.wait_for(svc.validate(3), 60))
    finally:
        svc.reward.close()
    assert out["val/mean@1/acc"] == 1.0 and out["val/failed_requests"] == 0.0
    assert out["val/multi_turn/turns/mean"] == 2.0 and out["val/multi_turn/tool_success_rate"] == 1.0
    assert out["val/response_length/mean"] > len(tok.encode("The answer is 42."))


def test_a_trajectory_in_flight_at_a_checkpoint_is_regenerated_exactly_once(setup, tiny_model_dir):
    """Checkpoint while trajectories wait on tools; 'crash'; a new service resumes: every prompt exactly once."""
    tok = load_tokenizer(tiny_model_dir)
    first = ScriptedToolEngine(tok, script, token_delay=0.002)
    # the built-in scorer runs inline: groups reach the queue as their trajectories end (no scorer-pool start-up)
    svc, handle = make_service(setup, tiny_model_dir, first, custom_reward=False)

    async def until_checkpoint():
        task = asyncio.create_task(svc.run())
        while not handle.groups:
            assert not task.done(), task
            await asyncio.sleep(0.01)
        await svc.pause_for_sync()
        state = svc.state_dict()
        queued = [g.uid for g in handle.groups]
        in_flight = [p["uid"] for p in state["pending"]]
        svc.stop()  # the crash: nothing after the checkpoint counts
        await asyncio.wait([task], timeout=10)
        return state, queued, in_flight

    try:
        state, queued, in_flight = asyncio.run(until_checkpoint())
    finally:
        svc.reward.close()
    assert queued and in_flight and not set(queued) & set(in_flight)
    second = ScriptedToolEngine(tok, script, token_delay=0.002)
    resumed, handle2 = make_service(setup, tiny_model_dir, second, "run2", custom_reward=False)
    try:
        assert resumed.load_state_dict(state, queued_uids=queued) == len(in_flight)
        asyncio.run(asyncio.wait_for(resumed.run(), 60))
    finally:
        resumed.reward.close()
    after = [g.uid for g in handle2.groups]
    assert sorted(queued + after) == [f"0:{k}" for k in range(6)]  # each prompt exactly once
    assert set(in_flight) <= set(after)
    for group in handle2.groups:
        for r in group.responses:  # regenerated from the start: whole trajectories
            assert tok.decode(r.token_ids).startswith("Let me use the tool.")
            assert r.agent_info["tool_calls"] == 1


def test_a_multi_turn_validation_past_its_timeout_aborts_the_turn_on_the_engine(tmp_path):
    """Every turn of a validation trajectory runs under the sample's request id, so the validator's abort reaches it."""
    from types import SimpleNamespace

    from verl_async.models.tiny import build_char_tokenizer
    from verl_async.rollout.agent_loop import MultiTurnSettings, ToolAgentLoop
    from verl_async.rollout.engine import SamplingParams
    from verl_async.rollout.validation import ValidationError, Validator
    from verl_async.tools.calculator import CalculatorTool
    from verl_async.utils.timeline import Timeline

    tok = build_char_tokenizer()

    class HangsOnSecondTurn(ScriptedToolEngine):
        def __init__(self):
            super().__init__(tok, script)
            self.second_turns, self.aborted_ids = [], []

        async def generate(self, request):
            if request.prefix_token_ids:
                self.second_turns.append(request.request_id)
                await asyncio.sleep(3600)
            return await super().generate(request)

        async def abort(self, request_ids=None):
            self.aborted_ids += list(request_ids or [])

    engine = HangsOnSecondTurn()
    loop = ToolAgentLoop({"calculator": CalculatorTool({})}, tok, MultiTurnSettings(), budget=200)
    items = [SimpleNamespace(index=i, prompt_ids=tok.encode("What is 6*7?"), data_source="toy", ground_truth="42",
                             extra_info={}, agent_name="") for i in range(2)]
    validator = Validator(items, None, SamplingParams(max_tokens=200, seed=1), k=1, max_num_seqs=4,
                          timeline=Timeline(None, time.time()), timeout_s=1.0, agent_loop=loop)
    with pytest.raises(ValidationError, match="did not finish within 1 s"):
        asyncio.run(validator.run([engine], version=7))
    assert sorted(engine.second_turns) == ["val-7-0-0", "val-7-1-0"]
    assert set(engine.second_turns) <= set(engine.aborted_ids)
