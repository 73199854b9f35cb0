"""The multi-turn agent loop: one response of a group as a whole tool-using trajectory (verl's ToolAgentLoop).

    generate a model turn -> parse its tool calls -> run them (concurrently) -> append the
    answers through the chat template -> generate the next turn ... until a turn has no
    call, `max_assistant_turns` / `max_user_turns`, or the response budget

The trajectory is ONE response of its group: model tokens with their log-probs, versions
and loss mask 1; the inserted tokens (tool answers, template glue) with log-prob 0,
version -1 and loss mask 0. `max_response_length` counts every token after the prompt.

Each turn is the Rollouter's `generate_one` continuing the trajectory as its prefix, so
what holds for one response holds per turn: engine errors are retried (a trajectory whose
turn still fails is dropped with its group, which is generated again), and a weight sync
in the middle of a turn aborts it and continues it under the new weights (per-token
versions cover all turns). Tools run while the engine serves other trajectories; a sync
may happen while they run. A trajectory in flight at a checkpoint is continued after a resume
from its last complete turn (and the tokens of the turn under way: rollout/partials.py); its
tool instances start afresh. Rows pick the loop with verl's `agent_name` column:
`tool_agent` (the default when multi_turn is on) or `single_turn_agent`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence

from verl_async.protocol import Response
from verl_async.rollout.agent_stats import AgentStats, TrajectoryRecord
from verl_async.rollout.chat_turns import ToolTurnTemplate
from verl_async.rollout.engine import GenerateResult
from verl_async.rollout.tool_parser import MALFORMED, FunctionCall, ParsedTurn, tool_parser
from verl_async.rollout.tool_session import ToolSession
from verl_async.tools.tool_registry import schema_dict

logger = logging.getLogger(__name__)

TOOL_AGENT, SINGLE_TURN_AGENT = "tool_agent", "single_turn_agent"
AGENT_NAMES = (TOOL_AGENT, SINGLE_TURN_AGENT)

# One model turn: continue `prefix` (None: the first turn) and return the whole response so far, or None
# when the engines failed it.
TurnGenerator = Callable[[Optional[Response]], Awaitable[Optional[Response]]]


@dataclass(frozen=True)
class MultiTurnSettings:
    max_assistant_turns: Optional[int] = None
    max_user_turns: Optional[int] = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_timeout_s: float = 60.0

    @classmethod
    def from_config(cls, mt: Mapping[str, Any]) -> "MultiTurnSettings":
        return cls(**{k: mt[k] for k in cls.__dataclass_fields__})


@dataclass
class Trajectory:
    """The response so far: what the next turn continues, and what the group will hold."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_rewards: list[float] = field(default_factory=list)
    last: Optional[Response] = None  # the latest model turn's result (replica, times)

    def __len__(self) -> int:
        return len(self.token_ids)

    def prefix(self) -> Optional[Response]:
        if not self.token_ids:
            return None
        return Response(list(self.token_ids), list(self.log_probs), list(self.versions), "abort",
                        start_time=self.last.start_time if self.last else 0.0)

    def add_model_turn(self, result: Response) -> list[int]:
        """Take a turn's result (prefix + new tokens); returns the new tokens."""
        new = slice(len(self.token_ids), len(result.token_ids))
        self.token_ids += result.token_ids[new]
        self.log_probs += result.log_probs[new]
        self.versions += result.versions[new]
        self.loss_mask += [1] * (new.stop - new.start)
        self.assistant_turns += 1
        self.last = result
        return result.token_ids[new]

    @classmethod
    def resumed(cls, saved: Mapping[str, Any]) -> tuple["Trajectory", Optional[Response]]:
        """A trajectory a checkpoint kept (rollout/partials.py), and the prefix its next turn continues (its tokens up
        to the last complete turn, plus those of the turn under way)."""
        agent = saved.get("agent") or {}
        start = int(saved.get("turn_start") or 0) if agent else 0
        mask = list(saved.get("loss_mask") or [1] * len(saved["token_ids"]))
        traj = cls(list(saved["token_ids"][:start]), list(saved["log_probs"][:start]), list(saved["versions"][:start]),
                   mask[:start], int(agent.get("assistant_turns", 0)), int(agent.get("user_turns", 0)),
                   int(agent.get("tool_calls", 0)), list(agent.get("tool_rewards", [])))
        prefix = Response(list(saved["token_ids"]), list(saved["log_probs"]), list(saved["versions"]), "abort") \
            if saved["token_ids"] else None
        return traj, prefix

    def counters(self) -> dict[str, Any]:
        return {"assistant_turns": self.assistant_turns, "user_turns": self.user_turns, "tool_calls": self.tool_calls,
                "tool_rewards": list(self.tool_rewards)}

    def add_inserted(self, ids: Sequence[int]) -> None:
        self.token_ids += list(ids)
        self.log_probs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.loss_mask += [0] * len(ids)


@dataclass
class TrajectoryResult(GenerateResult):
    """A validation trajectory as an engine result, with what the trajectory reported for the reward function."""

    agent_info: dict = field(default_factory=dict)


def reward_extra_info(extra_info: Mapping[str, Any], response: Any) -> dict:
    """The `extra_info` the reward function gets for one response (a Response or TrajectoryResult):
    the row's, plus what its trajectory reported (`agent_info`)."""
    info = getattr(response, "agent_info", None)
    return {**dict(extra_info or {}), **info} if info else dict(extra_info or {})


class ToolAgentLoop:
    def __init__(self, tools: Mapping[str, Any], tokenizer: Any, settings: MultiTurnSettings, *, budget: int,
                 call_format: str = "hermes", stats: Optional[AgentStats] = None) -> None:
        self.tools = dict(tools)
        self.tokenizer = tokenizer
        self.settings = settings
        self.budget = int(budget)  # max_response_length: every token after the prompt
        self.parser = tool_parser(call_format)
        self.schemas = [schema_dict(t) for t in self.tools.values()]
        self.template = ToolTurnTemplate(tokenizer, self.schemas)
        self.stats = stats or AgentStats()

    @classmethod
    def from_config(cls, rollout_cfg: Any, tokenizer: Any) -> Optional["ToolAgentLoop"]:
        """The loop for `actor_rollout_ref.rollout` (validated config), or None when multi_turn is off."""
        from verl_async.tools.tool_registry import load_all_tools

        mt = rollout_cfg.multi_turn
        if not mt.enable:
            return None
        tools = load_all_tools(mt.tool_config_path, mt.function_tool_path)
        return cls(tools, tokenizer, MultiTurnSettings.from_config(mt), budget=int(rollout_cfg.response_length),
                   call_format=str(mt.format))

    # ------------------------------------------------------------------ entry points
    async def generate_response(self, rollouter: Any, item: Any, i: int,
                                resume: Optional[Mapping[str, Any]] = None) -> Optional[Response]:
        """The Rollouter's hook: response `i` of `item`, each turn through `rollouter.generate_one`; `resume`: its state
        at a checkpoint (rollout/partials.py), continued. Each complete turn is reported to `rollouter.note_trajectory`."""
        def on_turn(traj: Trajectory) -> None:
            rollouter.note_trajectory(item, i, Response(list(traj.token_ids), list(traj.log_probs),
                                                        list(traj.versions), "abort", loss_mask=list(traj.loss_mask)),
                                      len(traj), traj.counters())

        return await self.run(lambda prefix: rollouter.generate_one(item, i, prefix=prefix), item,
                              timeline=rollouter.timeline, version=lambda: rollouter.version, resume=resume,
                              on_turn=on_turn)

    async def run(self, generate: TurnGenerator, item: Any, *, timeline: Any = None,
                  version: Callable[[], int] = lambda: -1, stats: Optional[AgentStats] = None,
                  resume: Optional[Mapping[str, Any]] = None,
                  on_turn: Optional[Callable[[Trajectory], None]] = None) -> Optional[Response]:
        """One response of `item` (a PromptTask or dataset item: `agent_name`, `extra_info`)."""
        agent = getattr(item, "agent_name", "") or TOOL_AGENT
        if agent not in AGENT_NAMES:
            raise ValueError(f"prompt {getattr(item, 'uid', getattr(item, 'index', '?'))}: agent_name={agent!r} is not "
                             f"supported (expected one of {AGENT_NAMES})")
        first: Optional[Response] = None
        traj = Trajectory()
        if resume:
            traj, first = Trajectory.resumed(resume)
        if agent == SINGLE_TURN_AGENT:
            return await generate(first)
        stats = stats or self.stats
        extra = dict(getattr(item, "extra_info", None) or {})
        session = ToolSession(self._active_tools(extra), extra.get("tools_kwargs"),
                              timeout_s=self.settings.tool_timeout_s,
                              max_response_chars=self.settings.max_tool_response_length,
                              truncate_side=self.settings.tool_response_truncate_side, agent_data=traj)
        calc_rewards: dict[str, float] = {}
        try:
            stop = await self._turns(generate, traj, session, stats, timeline, version, first, on_turn)
            if stop is None:
                return None
        finally:
            calc_rewards = await session.close()
        stop_reason, finish = stop
        stats.record_trajectory(TrajectoryRecord(traj.assistant_turns, traj.tool_calls, sum(traj.loss_mask),
                                                 len(traj) - sum(traj.loss_mask), stop_reason))
        last = traj.last
        return Response(
            token_ids=traj.token_ids, log_probs=traj.log_probs, versions=traj.versions, finish_reason=finish,
            replica=last.replica if last else -1, start_time=last.start_time if last else 0.0,
            end_time=last.end_time if last else 0.0, loss_mask=traj.loss_mask,
            agent_info={
                "num_turns": traj.assistant_turns + traj.user_turns + 1,  # verl's count (its prompt turn included)
                "assistant_turns": traj.assistant_turns, "user_turns": traj.user_turns, "tool_calls": traj.tool_calls,
                "tool_rewards": list(traj.tool_rewards), "turn_scores": [],
                "rollout_reward_scores": calc_rewards, "stop_reason": stop_reason,
            },
        )

    async def run_request(self, engine: Any, request: Any, item: Any, stats: AgentStats) -> "TrajectoryResult":
        """A validation request as a whole trajectory on one engine: its result holds every token.

        Each turn continues the trajectory on `engine` (a turn aborted by a sync is continued; an
        engine error ends it with that error, as a single-turn request's would).
        """
        error: list[str] = []

        async def turn(prefix: Optional[Response]) -> Optional[Response]:
            state = prefix
            while True:
                n = len(state) if state is not None else 0
                seed = request.sampling.seed
                sampling = replace(request.sampling, seed=None if seed is None else (seed + 7919 * n) & 0x7FFFFFFF)
                result = await engine.generate(replace(  # one id for all turns: the validator aborts it by that id
                    request, sampling=sampling,
                    prefix_token_ids=list(state.token_ids) if state else [],
                    prefix_log_probs=list(state.log_probs) if state else [],
                    prefix_versions=list(state.versions) if state else []))
                if result.error is not None:
                    error.append(result.error)
                    return None
                state = Response(result.token_ids, result.log_probs, result.versions, result.finish_reason)
                if result.finish_reason != "abort":
                    return state

        response = await self.run(turn, item, stats=stats)
        if response is None:
            return TrajectoryResult(request.request_id, [], [], [], "abort", error=error[-1] if error else "failed")
        return TrajectoryResult(request.request_id, response.token_ids, response.log_probs, response.versions,
                                response.finish_reason, agent_info=response.agent_info)

    def _active_tools(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        """verl's per-row `extra_info.tool_selection`: only those tools answer (others are unknown to the row)."""
        selection = extra.get("tool_selection")
        if not selection:
            return self.tools
        return {name: tool for name, tool in self.tools.items() if name in set(selection)}

    def _parse(self, new: Sequence[int]) -> ParsedTurn:
        """The turn's calls; a parser that fails on what a model wrote costs the turn one malformed call, never the run."""
        text = self.tokenizer.decode(new)
        try:
            return self.parser.parse(text)
        except Exception as exc:  # noqa: BLE001 - the parser's bug is answered to the model, and logged
            logger.warning("the %s parser failed on a model turn (%s: %s); answered as a malformed call",
                           type(self.parser).__name__, type(exc).__name__, exc)
            return ParsedTurn(text, [FunctionCall(MALFORMED, None, "the tool calls could not be read")], 1)

    # ------------------------------------------------------------------ the turns
    async def _turns(self, generate: TurnGenerator, traj: Trajectory, session: ToolSession, stats: AgentStats,
                     timeline: Any, version: Callable[[], int], first: Optional[Response] = None,
                     on_turn: Optional[Callable[[Trajectory], None]] = None) -> Optional[tuple[str, str]]:
        """Generate and answer turns; (stop reason, finish reason), or None when the engines failed a turn.
        `first`: the prefix of the first turn (a resumed trajectory's turn under way); `on_turn(traj)`: after each
        complete turn (its answer inserted)."""
        s = self.settings
        while True:
            result = await generate(first or traj.prefix())
            first = None
            if result is None:
                return None
            new = traj.add_model_turn(result)
            if result.finish_reason == "length" or len(traj) >= self.budget:
                return "length", "length"
            parsed = self._parse(new)
            calls = parsed.calls[: s.max_parallel_calls]
            stats.record_parse(parsed.malformed, len(parsed.calls) - len(calls))
            if not calls:
                return "no_call", "stop"
            if (s.max_assistant_turns and traj.assistant_turns >= s.max_assistant_turns) or \
                    (s.max_user_turns and traj.user_turns >= s.max_user_turns):
                return "turn_limit", "stop"
            start = timeline.now() if timeline is not None else 0.0
            outcomes = await asyncio.gather(*(session.call(c) for c in calls))
            if timeline is not None:
                timeline.record("rollout/tools", "tool", start, timeline.now(), version(),
                                calls=len(calls), names=[o.name for o in outcomes])
            for outcome in outcomes:
                stats.record_call(outcome.status, outcome.success, outcome.latency_s)
                traj.tool_rewards.append(outcome.reward)
            traj.tool_calls += len(outcomes)
            answer = self.template.tool_turn_ids(new, [o.text for o in outcomes])
            if len(traj) + len(answer) >= self.budget:  # no room left to answer: verl ends here too
                return "budget", "length"
            traj.add_inserted(answer)
            traj.user_turns += 1
            if on_turn is not None:
                on_turn(traj)
