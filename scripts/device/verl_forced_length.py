"""A verl agent loop that forces each response to a length drawn for its prompt (issue 27, throughput runs).

Our throughput workload (scripts/bench_async.py `write_workload`) stores per-response target lengths in
each row's `extra_info.target_lengths`; with `rollout.ignore_eos=true` our Rollouter stops response i
at target i. verl has no such hook, so this agent loop (registered through
`actor_rollout_ref.rollout.agent.agent_loop_config_path=scripts/device/verl_agent_loops.yaml`, made the
default with `...agent.default_agent_loop=forced_length_agent`) sets verl's per-request `max_tokens`
to one of its prompt's targets. verl spreads a group's n samples over its agent-loop workers and does
not tell a sample its index in the group, so each worker takes the targets of a prompt in turn: the
length distribution is the same, the exact assignment within a group may repeat a target.
"""

from __future__ import annotations

import collections
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

_turn: collections.Counter = collections.Counter()  # (prompt index) -> responses started in this worker


def forced_max_tokens(extra_info: Any, served: int) -> Any:
    """The target length for the `served`-th response of a prompt here, None without targets."""
    targets = (extra_info or {}).get("target_lengths") if isinstance(extra_info, dict) else None
    if targets is None or len(targets) == 0:
        return None
    return int(targets[served % len(targets)])


@register("forced_length_agent")
class ForcedLengthAgentLoop(SingleTurnAgentLoop):
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        extra = kwargs.get("extra_info")
        key = (extra or {}).get("index") if isinstance(extra, dict) else None
        target = forced_max_tokens(extra, _turn[key])
        _turn[key] += 1
        if target is not None:
            sampling_params = {**sampling_params, "max_tokens": target, "ignore_eos": True}
        return await super().run(sampling_params, **kwargs)
