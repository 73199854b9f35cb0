"""Healing without Ray (docs/healing.md): lost replicas, their healer, the queue's rewind, resumed partial responses.

The Rollouter's real scheduling code runs on in-process engines that die (raise ReplicaLost, as a dead replica's
proxy does), hang or slow down; the Ray drills that kill real processes are in tests/test_healing_drills.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
import pytest
import ray

from tests.fakes import FakeEngine
from tests.test_rollouter import ListSource, make, run_pipeline
from verl_async.config.fault_specs import Fault, FaultSpecError, parse_fail_replicas, parse_fail_trainer, replica_faults
from verl_async.errors import ReplicaLost
from verl_async.healing.report import heal_summary
from verl_async.healing.trainer import brief, is_trainer_death
from verl_async.protocol import Response, RolloutSample
from verl_async.queue import MessageQueue
from verl_async.rollout.agent_loop import Trajectory
from verl_async.rollout.engine import GenerateRequest, GenerateResult, SamplingParams
from verl_async.rollout.faults import FaultyEngine, with_faults
from verl_async.rollout.healing import ReplicaHealer
from verl_async.rollout.health import EngineFailure, ReplicaHealth
from verl_async.rollout.partials import PartialLog, finished, model_tokens
from verl_async.rollout.rollouter import PromptTask
from verl_async.rollout.watchdog import ProgressWatchdog


def within(coro, seconds: float):
    return asyncio.run(asyncio.wait_for(coro, seconds))


# --------------------------------------------------------------------------- the fault keys
def test_fail_replicas_entries_parse_to_faults_per_replica_and_life():
    table = parse_fail_replicas([0, "1:die@3", "all:slow=0.5@2", "2:crash=0.1@4", "1:hang"], replicas=3)
    assert table == {"0": [Fault("error")], "1": [Fault("die", 3), Fault("hang", 1)],
                     "all": [Fault("slow", 2, 0.5)], "2": [Fault("crash", 4, 0.1)]}
    # die and hang are first-life faults: the restarted replica serves; crash and slow stay
    assert [f.kind for f in replica_faults(1, [0, "1:die@3", "all:slow=0.5"], life=0)] == ["slow", "die"]
    assert [f.kind for f in replica_faults(1, [0, "1:die@3", "all:slow=0.5"], life=1)] == ["slow"]
    assert [f.kind for f in replica_faults(2, ["2:crash@1"], life=3)] == ["crash"]
    assert parse_fail_replicas("all") == {"all": [Fault("error")]} and parse_fail_replicas(None) == {}
    for bad, words in (("0,1", "expected null, all or a list"), (["0:boom"], "unknown kind 'boom'"),
                       (["x:die"], "cannot read 'x:die'"), (["3:die"], "replica 3 does not exist"),
                       (["0:die@0"], "@N counts requests from 1"), ([True], "neither a replica index")):
        with pytest.raises(FaultSpecError, match=words):
            parse_fail_replicas(bad, replicas=2)


def test_fail_trainer_entries_name_a_rank_update_or_an_actor_sync():
    got = parse_fail_trainer(["rank1:die@update3=0.2", "actor:die@sync2"], world_size=2)
    assert [(f.who, f.rank, f.when, f.at, f.seconds) for f in got] == [("rank1", 1, "update", 3, 0.2),
                                                                       ("actor", None, "sync", 2, 0.05)]
    for bad, words in ((["rank2:die@update1"], "trainer rank 2 does not exist"),
                       (["actor:die@update1"], "a rank dies in an update"), (["rank0:hang@update1"], "cannot read"),
                       (["actor:die@sync0"], "count from 1")):
        with pytest.raises(FaultSpecError, match=words):
            parse_fail_trainer(bad, world_size=2)


def test_faulty_engine_dies_mid_request_hangs_and_slows_as_told():
    kills = []

    async def go():
        inner = FakeEngine(max_len=6, token_delay=0.01)
        dying = FaultyEngine(inner, [Fault("die", 2, 0.02)], kill=lambda: kills.append(inner.generated))
        await dying.generate(GenerateRequest("a", [1], SamplingParams(max_tokens=6)))
        assert kills == []
        await dying.generate(GenerateRequest("b", [1], SamplingParams(max_tokens=6)))
        assert len(kills) == 1  # killed inside its 2nd request, while it ran
        hung = FaultyEngine(FakeEngine(), [Fault("hang", 1)])
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(hung.generate(GenerateRequest("c", [1], SamplingParams(max_tokens=4))), 0.3)
        slow = FaultyEngine(FakeEngine(token_delay=0.0), [Fault("slow", 1, 0.2)])
        t0 = asyncio.get_running_loop().time()
        await slow.generate(GenerateRequest("d", [1], SamplingParams(max_tokens=2)))
        assert asyncio.get_running_loop().time() - t0 >= 0.2

    within(go(), 10)
    assert with_faults(FakeEngine(), 0, ["1:die@2"]).__class__ is FakeEngine
    assert isinstance(with_faults(FakeEngine(), 1, ["1:die@2"], life=0), FaultyEngine)
    assert with_faults(FakeEngine(), 1, ["1:die@2"], life=1).__class__ is FakeEngine  # restarted: it serves


# --------------------------------------------------------------------------- replicas: down, back, retired
def test_replica_health_down_back_and_retired():
    h = ReplicaHealth(3, max_consecutive_failures=2)
    assert h.take_down(0, "died") and not h.take_down(0, "again") and h.healing
    assert h.serving() == [1, 2] and h.serving([0]) == [1, 2]
    assert not h.record(0, "x") and not h.record(0, "y")  # a replica that is down is not counted out again
    h.back(0)
    assert h.serving() == [0, 1, 2] and h.consecutive[0] == 0 and not h.healing
    assert h.record(1, "a") is False and h.record(1, "b", take_out=False) and 1 not in h.out  # the caller heals it
    h.retire(1, "gone")
    h.retire(2, "gone")
    assert not h.all_out and h.serving() == [0]
    h.retire(0, "gone")
    assert h.all_out and "replica 0: gone" in str(h.failure())


class Scripted(FakeEngine):
    """A FakeEngine that dies (its proxy raises ReplicaLost) on the requests `dies_on` picks, as a replica whose
    process was killed under that request; `blocks` holds a request after 3 tokens until it is aborted."""

    def __init__(self, index: int, *, dies_on=lambda n, request: False, blocks: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.index, self.dies_on, self.blocks = index, dies_on, blocks
        self.requests: list[GenerateRequest] = []
        self.rejoined = 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        if self.dies_on(len(self.requests), request):
            await asyncio.sleep(0.01)
            raise ReplicaLost(self.index, "ActorDiedError: its process died")
        if self.blocks and not request.prefix_token_ids:
            abort = asyncio.Event()
            self._running[request.request_id] = abort
            tokens = [5, 6, 7]
            await abort.wait()
            self._running.pop(request.request_id, None)
            return GenerateResult(request.request_id, tokens, [-0.1] * 3, [self._version] * 3, "abort")
        return await super().generate(request)

    async def rejoin(self) -> int:
        self.rejoined += 1
        return self.version


def test_a_request_lost_with_its_replica_continues_elsewhere_from_the_tokens_it_had():
    """Replica 0 holds a partial response (aborted by a sync); its process dies under the continuation: the
    response continues on replica 1 from those 3 tokens, which keep version 0; the rest is version 1."""
    a = Scripted(0, blocks=True, dies_on=lambda n, r: n == 2, max_len=8)
    b = Scripted(1, max_len=8)
    ro, q = make(1, n=1, required=1, trigger=1, threshold=0.0, engine_list=[a, b])
    lost = []
    ro.healer = type("Healer", (), {"lost": lambda self, i, why, kill=False, engine=None: (
        lost.append((i, why, kill, engine)), ro.health.take_down(i, why))})()

    async def go():
        task = asyncio.create_task(ro.run())
        while not a._running:
            await asyncio.sleep(0.01)
        await ro.pause_for_sync()
        await ro.load_weights([], 1)
        await ro.resume_after_sync(1)
        await asyncio.wait_for(task, 10)
        return (await q.get_batch(1, 1))[0]

    group = within(go(), 20)
    response = group.responses[0]
    assert response.token_ids[:3] == [5, 6, 7] and response.versions[:3] == [0, 0, 0]
    assert set(response.versions[3:]) == {1} and response.replica == 1
    assert [r.prefix_token_ids for r in b.requests] == [[5, 6, 7]]  # continued, not regenerated
    assert lost == [(0, "ActorDiedError: its process died", False, a)] and ro.counters.lost_requests == 1
    assert group.param_version_start == 0 and group.min_version == 0


def restart_with(new_engines: list, log: list):
    async def restart(index, engine, kill):
        log.append((index, kill))
        await asyncio.sleep(0.01)
        return new_engines.pop(0)

    return restart


def test_a_dead_replica_restarts_rejoins_and_every_group_is_trained_once():
    a = Scripted(0, dies_on=lambda n, r: n == 3, seed=1, token_delay=0.01)
    fresh = Scripted(0, seed=3, token_delay=0.01)
    ro, q = make(8, n=2, required=2, trigger=1, threshold=0.5,
                 engine_list=[a, Scripted(1, seed=2, token_delay=0.01)])
    restarts: list = []
    healer = ReplicaHealer(ro, max_restarts=2, restart=restart_with([fresh], restarts), needs_weights=False)
    ro.healer = healer
    seen, _, _ = within(run_pipeline(ro, q, 2, 1, 2), 30)
    assert sorted(seen) == sorted(f"e0-i{i}" for i in range(8))  # none lost, none twice
    assert restarts == [(0, False)] and fresh.rejoined == 1 and ro.engines[0] is fresh
    (event,) = healer.summary()
    assert event["outcome"] == "rejoined" and event["restart"] == 1 and event["rejoined_s"] >= event["restarted_s"]
    metrics = healer.metrics()
    assert metrics["fault/replica_restarts"] == 1 and metrics["fault/replicas_down"] == 0
    assert ro.health.serving() == [0, 1]


def test_a_restarted_replica_waits_for_the_current_weights_and_rejoins_with_them():
    a = Scripted(0, dies_on=lambda n, r: n == 1, seed=1)
    fresh = Scripted(0, seed=3)

    async def go():
        ro, q = make(4, n=2, required=2, trigger=1, threshold=0.5, engine_list=[a, Scripted(1, seed=2)])
        healer = ReplicaHealer(ro, max_restarts=1, restart=restart_with([fresh], []))
        ro.healer = healer
        pipeline = asyncio.create_task(run_pipeline(ro, q, 2, 1, 2))
        while not healer.awaiting_weights():
            await asyncio.sleep(0.01)
        assert ro.health.serving() == [1] and fresh.rejoined == 0  # restarted, fenced: no request yet
        assert healer.begin_push(7) == [0]
        loaded = []
        await healer.push_bucket(lambda e: asyncio.sleep(0, loaded.append(e)))
        assert await healer.end_push(lambda e: asyncio.sleep(0, True)) == 1
        assert loaded == [fresh] and fresh.rejoined == 1 and ro.health.serving() == [0, 1]
        await pipeline
        return healer

    healer = within(go(), 30)
    assert healer.summary()[0]["version"] == 7 and healer.summary()[0]["outcome"] == "rejoined"


def test_a_replica_that_dies_in_every_life_is_retired_and_the_run_goes_on():
    always = lambda n, r: True  # noqa: E731
    lives = [Scripted(0, dies_on=always) for _ in range(2)]
    ro, q = make(6, n=2, required=2, trigger=1, threshold=0.5,
                 engine_list=[Scripted(0, dies_on=always), Scripted(1, seed=2, token_delay=0.02)])
    healer = ReplicaHealer(ro, max_restarts=2, restart=restart_with(lives, []), needs_weights=False,
                           retire=lambda i, e: ended.append(i))
    ended: list = []
    ro.healer = healer
    seen, _, _ = within(run_pipeline(ro, q, 2, 1, 2), 30)
    assert sorted(seen) == sorted(f"e0-i{i}" for i in range(6))
    assert [e["outcome"] for e in healer.summary()] == ["rejoined", "rejoined", "retired"]
    assert ended == [0] and list(ro.health.out) == [0]
    assert "lost again after 2 restart(s) (rollout.max_replica_restarts)" in ro.health.out[0]


def test_every_replica_retired_stops_the_run_with_their_causes():
    always = lambda n, r: True  # noqa: E731
    ro, q = make(4, n=2, required=2, trigger=1, threshold=0.5,
                 engine_list=[Scripted(0, dies_on=always), Scripted(1, dies_on=always)])
    ro.healer = ReplicaHealer(ro, max_restarts=0, restart=restart_with([], []))

    async def go():
        try:
            await ro.run()
        finally:
            await q.close()

    with pytest.raises(EngineFailure, match=r"every engine replica is out of rotation \(replica 0: ActorDiedError: its "
                                            r"process died; replica 1: ActorDiedError"):
        within(go(), 10)


def test_a_hung_replica_is_handed_to_the_healer_by_the_watchdog():
    class Hung(FakeEngine):
        async def generate(self, request):
            await asyncio.Event().wait()

    ro, _ = make(2, n=1, required=1, trigger=1, threshold=0.0, engine_list=[Hung(), FakeEngine(seed=2)])
    lost = []
    ro.healer = type("Healer", (), {"lost": lambda self, i, why, kill=False, engine=None: lost.append((i, kill, why))})()
    ro._requests_on[0]["r1"] = 0.0  # a request sent to replica 0 that never comes back

    async def go():
        dog = ProgressWatchdog(ro, timeout_s=0.3, poll_s=0.05)
        task = asyncio.create_task(dog.run())
        await asyncio.sleep(0.8)
        task.cancel()

    within(go(), 5)
    assert lost and lost[0][:2] == (0, True) and lost[0][2].startswith("hung: it held 1 request(s) and made no token")


# --------------------------------------------------------------------------- the queue's rewind
def group(uid: str) -> RolloutSample:
    return RolloutSample(uid, [1], [Response([2], [-0.1], [0], "stop")])


def test_the_queue_gives_back_what_a_dead_trainer_took_since_its_checkpoint():
    async def go():
        q = MessageQueue(10, keep_taken=True)
        for i in range(6):
            await q.put(group(f"g{i}"))
        await q.get_batch(2)
        q.checkpointed("/ckpt/global_step_1/actor")
        taken = await q.get_batch(3)
        back = await q.rewind()
        rest = await q.get_batch(4)
        return taken, back, rest, q.stats()

    taken, back, rest, stats = within(go(), 5)
    assert [g.uid for g in taken] == ["g2", "g3", "g4"]
    assert back == {"checkpoint": "/ckpt/global_step_1/actor", "groups": 3}
    assert [g.uid for g in rest] == ["g2", "g3", "g4", "g5"] and stats.consumed == 6
    assert within(MessageQueue(2).rewind(), 5) == {"checkpoint": None, "groups": 0}  # keep_taken off: nothing kept


# --------------------------------------------------------------------------- resume continues partial responses
def test_a_checkpoint_keeps_partial_responses_and_a_resume_continues_them():
    """Pause mid-generation (a sync, as a checkpoint sees it): every response in flight has its tokens; a new
    Rollouter given those prompts continues them (prefix = the saved tokens, versions kept), generating none twice."""
    async def first_life():
        ro, q = make(3, n=2, required=2, trigger=1, threshold=1.0, max_len=12, delay=0.02)
        task = asyncio.create_task(ro.run())
        while ro.counters.generated_tokens < 1 and not any(len(p) for p in ro._requests_on):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await ro.pause_for_sync()
        states = ro.pending_states()
        ro.stop()
        await asyncio.gather(task, return_exceptions=True)
        return states

    states = within(first_life(), 20)
    partial = [s for s in states if s["resume"]]
    assert partial, states
    saved = {(s["uid"], i): r for s in partial for i, r in s["resume"].items()}
    assert all(r["versions"] and set(r["versions"]) == {0} for r in saved.values())
    saved_tokens = sum(model_tokens(r) for r in saved.values())
    assert saved_tokens > 0

    recorder = Scripted(0, seed=5, max_len=12)
    ro2, q2 = make(0, n=2, required=2, trigger=1, threshold=1.0, max_len=12, engine_list=[recorder])
    ro2.prompts = ListSource(0)
    ro2.prompts.items = [PromptTask(**s) for s in states]
    ro2.version = 3

    async def second_life():
        await ro2.run()
        return await q2.get_batch(len(states), 1)

    groups = {g.uid: g for g in within(second_life(), 20)}
    assert set(groups) == {s["uid"] for s in states}
    for (uid, i), r in saved.items():
        response = groups[uid].responses[int(i)]
        assert response.token_ids[:len(r["token_ids"])] == r["token_ids"]
        assert response.versions[:len(r["versions"])] == r["versions"]  # staleness counts as it would have
        assert groups[uid].param_version_start == 0 and groups[uid].min_version == 0
        if not finished(r, 12):  # its next request continued from the saved tokens
            assert any(q.prefix_token_ids == r["token_ids"] for q in recorder.requests)
    c = ro2.counters
    assert c.resume_continued_tokens == saved_tokens and c.resume_regenerated_tokens == 0
    assert c.resume_continued_responses == len(saved)


def test_a_trajectory_resumes_from_its_last_complete_turn_with_the_turn_under_way():
    log = PartialLog()
    turn1 = Response([1, 2, 3, 9, 9], [-0.1, -0.2, -0.3, 0.0, 0.0], [0, 0, 0, -1, -1], "abort", loss_mask=[1, 1, 1, 0, 0])
    log.note("u", 0, {**asdict(turn1), "turn_start": 5,
                      "agent": {"assistant_turns": 1, "user_turns": 1, "tool_calls": 1, "tool_rewards": [0.5]}})
    log.note_tokens("u", 0, Response([1, 2, 3, 9, 9, 4, 5], [-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5], [0, 0, 0, -1, -1, 1, 1],
                                     "abort"))
    saved = log.to_resume("u")["0"]
    assert saved["loss_mask"] == [1, 1, 1, 0, 0, 1, 1] and model_tokens(saved) == 5 and saved["turn_start"] == 5
    traj, first = Trajectory.resumed(saved)
    assert traj.token_ids == [1, 2, 3, 9, 9] and traj.loss_mask == [1, 1, 1, 0, 0]
    assert (traj.assistant_turns, traj.user_turns, traj.tool_calls, traj.tool_rewards) == (1, 1, 1, [0.5])
    assert first.token_ids == [1, 2, 3, 9, 9, 4, 5] and first.versions[5:] == [1, 1]
    new = traj.add_model_turn(Response(first.token_ids + [6], first.log_probs + [-0.6], first.versions + [2], "stop"))
    assert new == [4, 5, 6] and traj.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1]  # the turn under way: model tokens


# --------------------------------------------------------------------------- the trainer side, the report
def test_only_process_deaths_restart_the_trainer():
    class WorkerGroupError(RuntimeError):
        pass

    died = ray.exceptions.ActorDiedError()
    assert is_trainer_death(died)
    wrapped = RuntimeError("sync failed")
    wrapped.cause = died
    assert is_trainer_death(wrapped)
    assert is_trainer_death(WorkerGroupError("fsdp_actor: worker rank 1 died during update"))
    assert not is_trainer_death(ValueError("update: batch['advantages'] holds NaN"))
    assert brief("WorkerGroupError: rank 0 died: The actor died.\n\tclass_name: FSDPWorker") == \
        "WorkerGroupError: rank 0 died: The actor died."


def test_the_end_of_a_run_says_what_healed(capsys):
    events = [{"replica": 0, "cause": "ActorDiedError: its process died", "restart": 1, "detected_at": 3.0,
               "restarted_s": 4.0, "rejoined_s": 5.5, "version": 3, "outcome": "rejoined"},
              {"replica": 1, "cause": "hung", "restart": 1, "detected_at": 9.0, "restarted_s": None,
               "rejoined_s": None, "version": None, "outcome": "restarting"}]
    trainer = [{"restart": 1, "cause": "x", "checkpoint": "/c", "groups_back": 2, "recovery_s": 12.5, "step": 4}]
    out = heal_summary(events, trainer)
    assert out == {"fault/replica_restarts": 1.0, "fault/replicas_retired": 0.0, "fault/replica_rejoin_s_max": 5.5,
                   "fault/trainer_restarts": 1.0, "fault/trainer_recovery_s_max": 12.5}
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["healed: engine replica 0 was lost (ActorDiedError: its process died); restarted in 4.0 s, "
                     "rejoined 5.5 s after the loss with the weights of version 3",
                     "warning: engine replica 1 was lost (hung) and had not rejoined when the run ended (restarting)",
                     "healed: the trainer died (x); restarted from /c at step 4, generation resumed 12.5 s after the "
                     "death, 2 group(s) back to the queue"]
    assert heal_summary([], []) == {}


def test_a_trajectory_in_flight_at_a_checkpoint_resumes_in_the_agent_loop_without_running_its_tools_again():
    """Multi-turn: a checkpoint during the second model turn keeps the first turn, the tool's answer (mask 0) and the
    second turn's tokens so far; the resumed Rollouter continues that turn and the response equals an uninterrupted
    one: same text, mask and turn counts, the tool not called again."""
    from tests.agent_fakes import call
    from tests.test_agent_loop import PROMPT, TOK, Tool, build, segments

    long_turn = "The second turn is long enough to be cut by the checkpoint's sync. " * 2
    script = lambda uid, i, turn, ctx: [call("calc", x=1), long_turn][turn]  # noqa: E731
    answers = []

    async def answer(arguments):
        answers.append(arguments)
        return "2"

    tool = Tool("calc", answer)
    ro, _, (engine,), _ = build(script, [tool], token_delay=0.004)

    async def first_life():
        task = asyncio.create_task(ro.run())
        while not any(key[2] == 1 for key in engine.contexts):  # the second turn has started
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await ro.pause_for_sync()  # as a checkpoint sees it
        states = ro.pending_states()
        ro.stop()
        await asyncio.gather(task, return_exceptions=True)
        return states

    (state,) = within(first_life(), 30)
    saved = state["resume"]["0"]
    start = saved["turn_start"]
    assert saved["agent"] == {"assistant_turns": 1, "user_turns": 1, "tool_calls": 1, "tool_rewards": [0.0]}
    assert 0 < start < len(saved["token_ids"]) and saved["loss_mask"][start:] == [1] * (len(saved["token_ids"]) - start)
    assert 0 in saved["loss_mask"][:start] and answers == [{"x": 1}]

    engine._paused.set()  # the same engine object plays the continued turn (a real engine continues any prefix)
    ro2, _, _, sink = build(script, [tool], items=[PromptTask(**state)])
    ro2.engines = [engine]
    within(ro2.run(), 30)
    (response,) = sink.groups[0].responses
    assert engine.requests[-1].prefix_token_ids[:len(saved["token_ids"])] == saved["token_ids"]
    assert TOK.decode(response.token_ids).endswith(long_turn + "<|im_end|>")
    assert [m for m, _ in segments(response)] == [1, 0, 1] and answers == [{"x": 1}]  # no second tool call
    assert response.token_ids[:len(saved["token_ids"])] == saved["token_ids"]
    assert response.loss_mask[:len(saved["loss_mask"])] == saved["loss_mask"]
    assert (response.agent_info["assistant_turns"], response.agent_info["user_turns"],
            response.agent_info["tool_calls"]) == (2, 1, 1)
    assert ro2.counters.resume_continued_tokens == model_tokens(saved) and list(PROMPT) == state["prompt_ids"]
