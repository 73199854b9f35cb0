"""What the Rollouter is built from: one prompt's task, and the protocols of its sources, scorer, sink and policy.

Plain data and typing.Protocols (no Ray, no engine): the service, the scheduling policies, the agent loop and
tests build against these, and the Rollouter (rollouter.py) drives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from verl_async.protocol import Response, RolloutSample


@dataclass
class PromptTask:
    """What the Rollouter needs of one dataset row."""

    uid: str
    index: int
    epoch: int
    prompt_ids: list[int]
    data_source: str = ""
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0  # earlier groups of this prompt dropped after engine errors
    agent_name: str = ""  # verl's per-row agent loop (multi-turn: tool_agent | single_turn_agent)
    messages: list[dict] = field(default_factory=list)  # the prompt as chat messages (a reward model's own template)
    # After a resume: response index -> its state at the checkpoint, continued instead of regenerated
    # (rollout/partials.py), and the weight version current when the group first started.
    resume: dict[str, Any] = field(default_factory=dict)
    version_start: Optional[int] = None


def target_length(item: PromptTask, i: int) -> Optional[int]:
    """Workload hook (scripts/bench_async.py): a row's `extra_info.target_lengths` caps response i.

    With `rollout.ignore_eos=true` it forces each response to its drawn length, giving a
    benchmark a controlled long-tail length distribution on a random-weight model.
    """
    lengths = (item.extra_info or {}).get("target_lengths")
    return int(lengths[i % len(lengths)]) if lengths else None


class PromptSource(Protocol):
    def next(self) -> Optional[PromptTask]: ...
    def push_front(self, items: Sequence[PromptTask]) -> None: ...
    def state_dict(self) -> dict: ...


class GroupScorer(Protocol):
    async def __call__(self, item: PromptTask, responses: list[Response]) -> list[tuple[float, dict[str, float]]]: ...


class SampleSink(Protocol):
    async def put(self, sample: RolloutSample) -> None: ...
    async def size(self) -> int: ...


class SchedulingPolicy(Protocol):
    """How one admitted prompt's `n` responses are generated (PlainPolicy; P-DSR in pdsr_policy.py).

    Built by the Rollouter as `policy(rollouter, **scheduling_kwargs)`; its builder picks the class
    (rollout/scheduling.py maps the config's name to it), so this module imports no policy but the plain one.
    May also define `on_admission_stalled(reason)` and `metrics()`.
    """

    async def generate_group(self, item: PromptTask) -> Optional[list[Response]]: ...


@dataclass
class RolloutCounters:
    started_groups: int = 0
    finished_groups: int = 0
    dropped_groups_engine_error: int = 0
    retried_prompts: int = 0  # dropped groups whose prompt was queued again
    failed_prompts: int = 0  # prompts dropped max_prompt_retries + 1 times: never trained
    replicas_out_of_rotation: int = 0
    engine_errors: int = 0
    resume_continued_responses: int = 0  # responses a checkpoint held in flight, continued after the resume
    resume_continued_tokens: int = 0  # their tokens: generated before the restart, not again
    resume_regenerated_tokens: int = 0  # tokens a checkpoint held that were thrown away (their group was retried)
    lost_requests: int = 0  # requests whose replica died under them (continued on another one)
    aborted_requests: int = 0
    continued_requests: int = 0
    generated_tokens: int = 0
    pause_time_s: float = 0.0  # time spent waiting on the staleness budget / sync
    busy_time_s: float = 0.0  # time with at least one request in flight
