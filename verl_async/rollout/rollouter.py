"""The Rollouter: prompts in, complete scored groups out, never too far ahead.

It admits a prompt only while the staleness budget allows (docs/architecture.md "Staleness"), runs
its `n` responses on the engine replicas, scores the group and puts ONE
`RolloutSample` into the queue. A weight sync pauses it:

* `partial_rollout=True`: in-flight requests are aborted, keep their tokens and
  log-probs, and continue under the new weights after the sync (each token keeps the
  version that sampled it);
* `partial_rollout=False`: no new requests start and the in-flight ones finish first.

Finished groups wait with their put until the sync ends, so a checkpoint taken while
paused sees each group either in the queue or among the pending prompts.

Faults (docs/troubleshooting.md): a request that fails is retried
(`MAX_ENGINE_RETRIES`); a group with a response that still failed is dropped, gives its
staleness slot back, and its prompt is generated again later, at most
`max_prompt_retries` times, before it is counted as failed (`failed_prompts`, listed in
`failed_log`) and the run goes on without it. A replica with
`max_consecutive_engine_failures` failed requests in a row leaves the rotation
(`rollout.health`); when none is left the run stops with the engine's error. Requests
on the engines with no token and no group for `progress_timeout_s` stop the run too
(`rollout.watchdog`: a wedged engine never answers, so no error ever comes).
A group that `algorithm.filter_groups` drops (rollout/group_filter.py) frees its slot; its prompt is consumed.

This is a plain asyncio class; the recipe wraps it in an async Ray actor.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
import zlib
from dataclasses import asdict, replace
from typing import Any, Callable, Collection, Iterable, Optional, Sequence

import torch

from verl_async.protocol import Response, RolloutSample
from verl_async.rollout.engine import GenerateRequest, GenerateResult, InferenceEngine, SamplingParams
from verl_async.rollout.group_filter import GroupFilter
from verl_async.rollout.health import EngineFailure, ReplicaHealth, ReplicaLost
from verl_async.rollout.lengths_log import append_jsonl, lengths_record
from verl_async.rollout.partials import PartialLog, entry, finished, model_tokens, response_of
from verl_async.rollout.task import (  # noqa: F401 - the Rollouter's contract, importable from here too
    GroupScorer,
    PromptSource,
    PromptTask,
    RolloutCounters,
    SampleSink,
    SchedulingPolicy,
    target_length,
)
from verl_async.rollout.watchdog import ProgressWatchdog
from verl_async.staleness import StalenessBudget
from verl_async.utils.busy_clock import BusyClock
from verl_async.utils.timeline import Timeline

logger = logging.getLogger("verl_async.rollouter")


class Rollouter:
    MAX_ENGINE_RETRIES = 2
    # A sync's abort that a replica has not answered for this long, with a healer: the replica is hung and healed.
    ABORT_GRACE_S = 30.0

    def __init__(
        self,
        *,
        engines: Sequence[InferenceEngine],
        prompts: PromptSource,
        scorer: GroupScorer,
        sink: SampleSink,
        n: int,
        sampling: SamplingParams,
        budget: StalenessBudget,
        partial_rollout: bool,
        max_inflight_groups: int,
        total_prompts: Optional[int] = None,
        timeline: Optional[Timeline] = None,
        lengths_log: Optional[str] = None,
        version: int = 0,
        scheduling: Optional[Callable[..., SchedulingPolicy]] = None,
        scheduling_kwargs: Optional[dict[str, Any]] = None,
        engine_capacity: Optional[Sequence[int]] = None,
        max_prompt_retries: int = 2,
        max_consecutive_engine_failures: int = 32,
        failed_log: Optional[str] = None,
        progress_timeout_s: Optional[float] = None,
        group_filter: Optional[GroupFilter] = None,
        agent_loop: Optional[Any] = None,
        response_hook: Optional[Callable[[PromptTask, Response], Any]] = None,
    ) -> None:
        if not engines:
            raise ValueError("Rollouter needs at least one engine replica")
        self.engines = list(engines)
        self.prompts = prompts
        self.scorer = scorer
        self.sink = sink
        self.n = n
        self.sampling = sampling
        self.budget = budget
        self.partial_rollout = partial_rollout
        self.max_inflight_groups = max(1, max_inflight_groups)
        self.total_prompts = total_prompts
        self.timeline = timeline or Timeline(None, time.time())
        self.lengths_log = lengths_log
        self.version = version
        self.counters = RolloutCounters()
        self.max_prompt_retries = max(0, int(max_prompt_retries))
        self.health = ReplicaHealth(len(self.engines), max_consecutive_engine_failures)
        self.healer: Optional[Any] = None  # rollout/healing.ReplicaHealer (the service sets it); None: lost = out
        self._replica_event = asyncio.Event()  # a replica came back or left for good
        self._lost_engines_logged: list[Any] = []  # the replica proxies whose loss was logged (a restart: a new one)
        self.returned_requests = [0] * len(self.engines)  # per replica: requests that came back (the watchdog)
        self.partials = PartialLog()  # the responses of groups in flight, as far as known (a checkpoint keeps them)
        self.failed_log = failed_log
        self.progress_timeout_s = progress_timeout_s  # None: no progress watchdog (tests that do not need it)
        self.group_filter = group_filter  # None: every scored group goes to the queue
        self.failed: list[dict[str, Any]] = []  # prompts given up on (uid, index, epoch, attempts, error)
        self.last_engine_error: Optional[str] = None
        self._retry: collections.deque[PromptTask] = collections.deque()  # dropped prompts to generate again
        self._source_done = False
        self._inflight: dict[str, tuple[PromptTask, asyncio.Task]] = {}
        self._admitted_at: dict[str, int] = {}  # in-flight uid -> the version it was admitted under
        self._requests_on: list[dict[str, float]] = [{} for _ in self.engines]  # request id -> start (monotonic)
        # concurrent sequences each replica runs (max_num_seqs); pick_engine balances load / capacity
        self.engine_capacity = [max(1, int(c)) for c in (engine_capacity or [1] * len(self.engines))]
        if len(self.engine_capacity) != len(self.engines):
            raise ValueError(f"engine_capacity has {len(self.engine_capacity)} entries for {len(self.engines)} engines")
        self.replica_busy = [BusyClock() for _ in self.engines]  # time with >= 1 generation request on the replica
        self.generation_busy = BusyClock()  # time with >= 1 generation request on any replica (counters.busy_time_s)
        # time with >= 1 request of any kind on an engine: generation and validation (rollout/idle_ratio)
        self.engine_busy = BusyClock()
        self.group_latencies: collections.deque[float] = collections.deque(maxlen=10000)  # submit -> finish, s
        self._open = asyncio.Event()  # set = generation allowed (not inside a sync)
        self._open.set()
        self._changed = asyncio.Event()  # wakes the admission loop
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop = False
        self._last_event = time.monotonic()  # a group started or ended, a sync reopened the budget
        self._failure: Optional[BaseException] = None
        self._next_item: Optional[PromptTask] = None  # taken from the source, not started yet
        self._serial = 0
        self.agent_loop = agent_loop  # multi-turn: rollout/agent_loop.ToolAgentLoop, one trajectory per response
        # awaited with each finished response while the group's others still generate (distillation's teachers,
        # verl_async/teachers/); must skip a response it has seen: it runs again on the whole group before scoring
        self.response_hook = response_hook
        self.policy = (scheduling or PlainPolicy)(self, **dict(scheduling_kwargs or {}))
        for path in (lengths_log, failed_log):
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    # ------------------------------------------------------------------ main loop
    async def run(self) -> RolloutCounters:
        """Generate until the data ends, under the progress watchdog when `progress_timeout_s` is set."""
        watchdog = None
        if self.progress_timeout_s is not None:
            watchdog = asyncio.create_task(ProgressWatchdog(self, self.progress_timeout_s).run(), name="watchdog")
            watchdog.add_done_callback(self._on_watchdog_done)
        try:
            return await self._generate_all()
        finally:
            if watchdog is not None:
                watchdog.cancel()

    def _on_watchdog_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fail(task.exception())

    async def _generate_all(self) -> RolloutCounters:
        """Admit prompts until the data (or total_prompts) is exhausted; wait for the tail.

        Dropped prompts come back before new data, also after the data ended, so the tail
        waits for each in-flight group and takes its retry if it brings one.
        """
        while not self._stop:
            # Take the prompt before waiting: the end of the data must end the run even while
            # the budget is exhausted (the trainer may need no further sync to drain the tail).
            item = self._take()
            if item is None:
                self._admission_stalled("end")
                if not self._inflight or self._failure:
                    break
                await asyncio.wait([t for _, t in self._inflight.values()], return_when=asyncio.FIRST_COMPLETED)
                continue
            self._next_item = item
            wait_start, span_start = time.monotonic(), self.timeline.now()
            reason = await self._admission_gate()
            self.counters.pause_time_s += time.monotonic() - wait_start
            if reason is not None:  # what held the next group back (budget | sync | inflight): the timeline shows it
                self.timeline.record("rollout/admission", f"hold_{reason}", span_start, self.timeline.now(),
                                     self.version)
            if self._stop:
                break
            self._next_item = None
            self._start_group(item)
        while self._inflight and not self._failure:  # stopped: the cancelled groups end
            await asyncio.wait([t for _, t in self._inflight.values()])
        if self._failure:
            raise self._failure
        if self.counters.failed_prompts and not self.counters.finished_groups and not self._stop:
            # fewer requests than it takes to put a replica out of rotation, all failed: still an engine failure
            raise EngineFailure(f"no group was generated: all {self.counters.failed_prompts} prompts failed "
                                f"after retries (last engine error: {self.last_engine_error})")
        return self.counters

    def _take(self) -> Optional[PromptTask]:
        """The next prompt: a dropped one to retry first, then the source (within total_prompts)."""
        if self._retry:
            return self._retry.popleft()
        if self._source_done or (self.total_prompts is not None and self.counters.started_groups >= self.total_prompts):
            return None
        item = self.prompts.next()
        self._source_done = item is None
        return item

    async def _admission_gate(self) -> Optional[str]:
        """Wait until a group may start; returns why it had to wait first (None: it did not)."""
        first: Optional[str] = None
        while not self._stop and not (
            self._open.is_set() and self.budget.can_start() and len(self._inflight) < self.max_inflight_groups
        ):
            if self._failure:
                raise self._failure
            reason = "sync" if not self._open.is_set() else "budget" if not self.budget.can_start() else "inflight"
            first = first or reason
            self._admission_stalled(reason)
            self._changed.clear()
            await self._changed.wait()
        if self._failure:
            raise self._failure
        return first

    def _poke(self) -> None:
        self._last_event = time.monotonic()
        self._changed.set()

    def idle_on_budget_s(self) -> float:
        """Seconds waited on an exhausted staleness budget with no group in flight (0: not so).

        Only a weight sync frees the budget and only the trainer syncs: if the trainer waits
        for groups all that time too, neither side can move (the trainer's deadlock check).
        """
        if self._next_item is None or self._inflight or self.budget.can_start() or not self._open.is_set():
            return 0.0
        return time.monotonic() - self._last_event

    def _admission_stalled(self, reason: str) -> None:
        """No group is admitted for now (reason: sync | budget | inflight | end); a policy that
        batches groups (P-DSR) must not wait for more that cannot come."""
        hook = getattr(self.policy, "on_admission_stalled", None)
        if hook is not None:
            hook(reason)

    @property
    def inflight_groups(self) -> int:
        return len(self._inflight)

    def oldest_inflight_version(self) -> Optional[int]:
        """The oldest weight version a group still in flight was admitted under (None: none in flight)."""
        live = [self._admitted_at[uid] for uid in self._inflight if uid in self._admitted_at]
        return min(live) if live else None

    @property
    def in_sync(self) -> bool:
        """Inside a weight sync (generation paused on purpose)."""
        return not self._open.is_set()

    def requests_on_engines(self) -> list[dict[str, float]]:
        """Per replica: the requests it holds now, request id -> when it was sent (time.monotonic())."""
        return [dict(held) for held in self._requests_on]

    def fail(self, exc: BaseException) -> None:
        """Stop the run with `exc` (the progress watchdog): in-flight groups are cancelled, `run` raises it."""
        if self._failure is None:
            self._failure = exc
            logger.error("rollout failed: %s", exc)
        for _, task in self._inflight.values():
            task.cancel()
        self._poke()

    def _start_group(self, item: PromptTask) -> None:
        if item.version_start is None:  # a resumed group keeps the version it first started under
            item.version_start = self.version
        self._last_event = time.monotonic()
        self.budget.on_start()
        self.counters.started_groups += 1
        task = asyncio.create_task(self._run_group(item), name=f"group-{item.uid}")
        self._inflight[item.uid] = (item, task)
        self._admitted_at[item.uid] = self.version
        task.add_done_callback(lambda t, uid=item.uid: self._on_group_done(uid, t))

    def _on_group_done(self, uid: str, task: asyncio.Task) -> None:
        if uid in self._inflight and self._inflight[uid][1] is task:  # a retry of the uid may run already
            del self._inflight[uid]
            self._admitted_at.pop(uid, None)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            logger.error("group %s failed: %r", uid, self._failure)
        self._poke()

    async def _run_group(self, item: PromptTask) -> None:
        version_start = self.version if item.version_start is None else item.version_start
        submit = self.timeline.now()
        results = await self.policy.generate_group(item)
        if results is None or any(r is None for r in results):
            self._abandon(item)
            return
        responses: list[Response] = list(results)
        if len(responses) != self.n:
            raise RuntimeError(f"scheduling policy returned {len(responses)} responses for {item.uid}, expected {self.n}")
        if self.response_hook is not None:  # responses a scheduling policy produced without generate_response
            await asyncio.gather(*(self.response_hook(item, r) for r in responses))
        scores = await self.scorer(item, responses)
        for resp, (reward, info) in zip(responses, scores):
            resp.reward = float(reward)
            resp.reward_info = dict(info)
        sample = RolloutSample(
            uid=item.uid,
            prompt_ids=list(item.prompt_ids),
            responses=responses,
            data_source=item.data_source,
            ground_truth=item.ground_truth,
            extra_info=dict(item.extra_info),
            epoch=item.epoch,
            index=item.index,
            param_version_start=version_start,
            param_version_end=self.version,
        )
        self._admitted_at.pop(item.uid, None)  # generated and scored: no longer "in flight" for a V1 wait
        finish = self.timeline.now()
        self.group_latencies.append(finish - submit)
        if self.lengths_log:
            append_jsonl(self.lengths_log, lengths_record(sample, submit, finish))
        await self._open.wait()  # no put inside a sync: a checkpoint's queue and pending list agree
        if self.group_filter is not None and not self.group_filter.keep(sample, self.version):
            self.budget.on_abandon()  # filtered after the sync wait: a checkpoint sees it pending or consumed
            return
        await self.sink.put(sample)
        self.partials.drop(item.uid)
        self.counters.finished_groups += 1

    def release_budget(self, groups: int) -> None:
        """The trainer dropped `groups` queued groups (algorithm.max_staleness): their slots are free again.

        Otherwise they hold the budget until the next sync, which needs a trainer step that may
        never fill: the same deadlock as a group dropped for engine errors.
        """
        for _ in range(max(0, int(groups))):
            self.budget.on_abandon()
        self._poke()

    def _abandon(self, item: PromptTask) -> None:
        """A group that will never reach the queue: free its budget slot, retry its prompt or give up."""
        self.budget.on_abandon()
        self.counters.dropped_groups_engine_error += 1
        self._inflight.pop(item.uid, None)
        self.partials.drop(item.uid)
        self.counters.resume_regenerated_tokens += sum(model_tokens(saved) for saved in item.resume.values())
        if item.attempts < self.max_prompt_retries:
            self.counters.started_groups -= 1  # started again from the retry queue
            self.counters.retried_prompts += 1
            self._retry.append(replace(item, attempts=item.attempts + 1, resume={}, version_start=None))
            logger.warning("group %s dropped after repeated engine errors (%s); its prompt is retried (%d of %d)",
                           item.uid, self.last_engine_error, item.attempts + 1, self.max_prompt_retries)
        else:
            self.counters.failed_prompts += 1
            record = {"uid": item.uid, "index": item.index, "epoch": item.epoch, "attempts": item.attempts + 1,
                      "error": self.last_engine_error}
            self.failed.append(record)
            if self.failed_log:
                append_jsonl(self.failed_log, record)
            logger.error("prompt %s failed %d times (last engine error: %s): it is not trained "
                         "(rollout/failed_prompts)", item.uid, item.attempts + 1, self.last_engine_error)
        self._poke()

    async def _pick(self, candidates: Optional[Sequence[int]], avoid: Collection[int]) -> int:
        """`pick_engine`, waiting while no replica serves but one is restarting (rollout/healing.py)."""
        while not self.health.serving(candidates) and self.health.healing and not self._failure:
            self._replica_event.clear()
            await self._replica_event.wait()
        return self.pick_engine(candidates, avoid)

    def _log_lost_request(self, index: int, engine: Any, request_id: str, why: str, tokens: int) -> None:
        """One warning per lost replica process (a replica holds up to max_num_seqs requests: one line each drowned
        the console), the rest at debug level; rollout/lost_requests counts them all."""
        if not any(seen is engine for seen in self._lost_engines_logged):
            self._lost_engines_logged.append(engine)
            logger.warning("engine replica %d lost (%s): its requests in flight continue from the tokens already "
                           "generated on a replica that serves (rollout/lost_requests counts them)", index, why)
        logger.debug("request %s lost with replica %d; it continues from its %d tokens", request_id, index, tokens)

    def replica_lost(self, index: int, why: str, *, kill: bool = False, engine: Any = None) -> None:
        """Replica `index` is gone (`kill`: it still runs but is broken or hung): healed when a healer is set, else out
        of rotation for good. `engine`: the proxy the loss was seen through (a stale one's report is ignored)."""
        if self.healer is not None:
            self.healer.lost(index, why, kill=kill, engine=engine)
        elif (engine is None or self.engines[index] is engine) and index not in self.health.out:
            self.health.retire(index, why)
            self.counters.replicas_out_of_rotation = len(self.health.out)
            self.replicas_changed()

    def replicas_changed(self) -> None:
        """A replica came back or left: requests waiting for one look again; with none left the run stops."""
        self._replica_event.set()
        if self.health.all_out:
            self.fail(self.health.failure())
        self._poke()

    def pick_engine(self, candidates: Optional[Sequence[int]] = None, avoid: Collection[int] = ()) -> int:
        """The least loaded replica (requests / capacity) in rotation among `candidates` (all by default).

        When none of `candidates` is in rotation any serving replica is taken (P-DSR keeps running on
        fewer replicas); when none serves at all the run fails with the replicas' own errors. A retry
        `avoid`s the replicas that failed it while others serve: a replica that fails at once is always
        the least loaded one and would draw every retry.
        """
        pool = self.health.serving(candidates)
        if not pool:
            raise self.health.failure()
        pool = [i for i in pool if i not in avoid] or pool
        return min(pool, key=lambda i: len(self._requests_on[i]) / self.engine_capacity[i])

    def response_seed(self, item: PromptTask, i: int, prefix_len: int = 0) -> Optional[int]:
        """Per-response seed, stable across processes and runs (no Python hash randomisation).

        A continuation (after an abort or a P-DSR move) gets a seed of its own, keyed by the
        prefix length, so its sampling noise does not replay the stream that made the prefix.
        """
        if self.sampling.seed is None:
            return None
        return zlib.crc32(f"{self.sampling.seed}/{item.uid}/{i}/{prefix_len}".encode()) & 0x7FFFFFFF

    async def generate_response(self, item: PromptTask, i: int) -> Optional[Response]:
        """Response `i` of `item`: one generation, or a whole tool-using trajectory with an agent loop."""
        if self.agent_loop is None:
            response = await self.generate_one(item, i)
        else:
            saved = self._take_resumed(item, i)
            if saved is not None and finished(saved, self.sampling.max_tokens):
                response = response_of(saved)
            else:
                response = await self.agent_loop.generate_response(self, item, i, resume=saved)
                if response is not None:
                    self.partials.note(item.uid, i, entry(response))
        if response is not None and self.response_hook is not None:
            await self.response_hook(item, response)
        return response

    def _take_resumed(self, item: PromptTask, i: int) -> Optional[dict]:
        """Response `i`'s state at the checkpoint this run resumed from (rollout/partials.py), once; None: none."""
        saved = item.resume.pop(str(i), None)
        if saved is None:
            return None
        self.counters.resume_continued_responses += 1
        self.counters.resume_continued_tokens += model_tokens(saved)
        self.partials.note(item.uid, i, saved)
        return saved

    def note_trajectory(self, item: PromptTask, i: int, trajectory: Response, turn_start: int,
                        agent: dict[str, Any]) -> None:
        """A trajectory's state at the end of a complete turn (the agent loop reports it; a checkpoint keeps it)."""
        self.partials.note(item.uid, i, entry(trajectory, turn_start=int(turn_start), agent=dict(agent)))

    async def generate_one(
        self,
        item: PromptTask,
        i: int,
        *,
        engines: Optional[Sequence[int]] = None,
        max_tokens: Optional[int] = None,
        prefix: Optional[Response] = None,
    ) -> Optional[Response]:
        """Response `i` of `item`: retried on engine errors, continued across syncs (partial rollout).

        `engines` restricts the replicas it may run on, `max_tokens` caps the whole response
        (prefix included) below the sampling default, `prefix` continues an earlier response
        (its tokens keep their log-probs and versions). None after repeated engine errors.
        """
        state = GenerateResult(
            request_id="",
            token_ids=list(prefix.token_ids) if prefix else [],
            log_probs=list(prefix.log_probs) if prefix else [],
            versions=list(prefix.versions) if prefix else [],
            finish_reason="abort",
        )
        sampling = self.sampling
        target = target_length(item, i)  # a benchmark's forced length holds under a P-DSR cap too
        if target is not None:
            max_tokens = target if max_tokens is None else min(int(max_tokens), target)
        if max_tokens is not None:
            sampling = replace(sampling, max_tokens=min(int(max_tokens), self.sampling.max_tokens))
        if prefix is None and self.agent_loop is None:  # after a resume: continue what the checkpoint held
            saved = self._take_resumed(item, i)
            if saved is not None:
                if finished(saved, sampling.max_tokens):
                    return response_of(saved)
                prefix = response_of(saved)
                state = GenerateResult("", list(prefix.token_ids), list(prefix.log_probs), list(prefix.versions),
                                       "abort")
        errors = 0
        failed_on: set[int] = set()
        started = prefix.start_time if prefix else None
        while True:
            await self._open.wait()
            idx = await self._pick(engines, failed_on)
            engine = self.engines[idx]
            request = GenerateRequest(
                request_id=f"{item.uid}/{i}/{self._request_serial()}",
                prompt_ids=item.prompt_ids,
                sampling=replace(sampling, seed=self.response_seed(item, i, len(state.token_ids))),
                prefix_token_ids=state.token_ids,
                prefix_log_probs=state.log_probs,
                prefix_versions=state.versions,
            )
            started = started if started is not None else self.timeline.now()
            self._request_started(idx, request.request_id)
            t0 = self.timeline.now()
            try:
                result = await engine.generate(request)
            except ReplicaLost as lost:  # its tokens since `state` died with it: continue from `state` elsewhere
                self.counters.lost_requests += 1
                self._log_lost_request(idx, engine, request.request_id, lost.reason, len(state.token_ids))
                self.replica_lost(idx, lost.reason, engine=engine)
                continue
            finally:
                self._request_finished(idx, request.request_id)
            new_tokens = len(result.token_ids) - len(state.token_ids)
            self.timeline.record(
                f"rollout/replica{idx}", "generate", t0, self.timeline.now(), self.version, tokens=max(0, new_tokens)
            )
            if self.health.record(idx, result.error, take_out=self.healer is None):
                if self.healer is not None:
                    self.replica_lost(idx, self.health.failures_in_a_row(idx), kill=True, engine=engine)
                self.counters.replicas_out_of_rotation = len(self.health.out)
                if self.health.all_out:
                    raise self.health.failure()
            if result.error is not None:
                errors += 1
                failed_on.add(idx)
                self.counters.engine_errors += 1
                self.last_engine_error = f"replica {idx}: {result.error}"
                logger.warning("engine error on %s (attempt %d): %s", request.request_id, errors, result.error)
                if errors > self.MAX_ENGINE_RETRIES:
                    return None
                continue
            self.counters.generated_tokens += new_tokens
            response = Response(
                token_ids=list(result.token_ids),
                log_probs=list(result.log_probs),
                versions=list(result.versions),
                finish_reason=result.finish_reason,
                replica=idx,
                start_time=started,
                end_time=self.timeline.now(),
            )
            self.partials.note_tokens(item.uid, i, response)  # what a checkpoint now would keep of it
            if result.finish_reason == "abort":
                self.counters.aborted_requests += 1
                if new_tokens > 0:
                    self.counters.continued_requests += 1
                state = result
                continue
            return response

    @property
    def _running_requests(self) -> int:
        """Generation requests on the engines now (the generation clock counts them)."""
        return self.generation_busy.running

    def replica_busy_seconds(self) -> list[float]:
        """Per replica: seconds with at least one generation request on it (the current busy span included)."""
        return [clock.seconds() for clock in self.replica_busy]

    def _request_serial(self) -> int:
        self._serial += 1
        return self._serial

    def _request_started(self, idx: int, request_id: str) -> None:
        self._requests_on[idx][request_id] = time.monotonic()
        for clock in (self.replica_busy[idx], self.generation_busy, self.engine_busy):
            clock.start()
        self._idle.clear()

    def _request_finished(self, idx: int, request_id: str) -> None:
        del self._requests_on[idx][request_id]
        self.returned_requests[idx] += 1
        for clock in (self.replica_busy[idx], self.generation_busy, self.engine_busy):
            clock.stop()
        self.counters.busy_time_s = self.generation_busy.closed_s
        if self._running_requests == 0:
            self._idle.set()

    # ------------------------------------------------------------------ sync
    async def pause_for_sync(self) -> None:
        """Stop generating; afterwards no request is running on any engine."""
        self._open.clear()
        if not self.partial_rollout:
            await self._idle.wait()
            return
        # Abort until idle: a request that slipped in just after an abort is aborted by the next.
        started = time.monotonic()
        while True:
            await self._abort_all()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=0.2)
                return
            except asyncio.TimeoutError:
                pass
            if self.healer is not None and time.monotonic() - started > self.ABORT_GRACE_S:
                for index, held in enumerate(self._requests_on):  # hung: healing kills it, its calls then return
                    if held:
                        self.replica_lost(index, f"did not answer an abort of its {len(held)} request(s) for "
                                                 f"{self.ABORT_GRACE_S:.0f} s", kill=True, engine=self.engines[index])
                started = time.monotonic()

    async def _abort_all(self) -> None:
        """Abort this Rollouter's requests on every replica; one out of rotation may be broken or dead: its error is
        logged. Only its own: a validation running beside it (trainer.val_async) stays on its version and the sync
        waits for it instead (rollout/background_validation.py)."""
        serving = set(self.health.serving())
        engines = list(self.engines)
        holding = [i for i, held in enumerate(self._requests_on) if held]  # a restarting replica holds none: not asked
        bound = self.ABORT_GRACE_S if self.healer is not None else None  # a hung replica's abort may never answer
        results = dict(zip(holding, await asyncio.gather(*(asyncio.wait_for(engines[i].abort(list(self._requests_on[i])),
                                                                            bound) for i in holding),
                                                         return_exceptions=True)))
        for index, result in results.items():
            if isinstance(result, ReplicaLost):  # its requests come back failed: they continue elsewhere
                self.replica_lost(index, result.reason, engine=engines[index])
            elif isinstance(result, asyncio.TimeoutError):  # pause_for_sync heals it once the grace has passed
                logger.warning("abort on replica %d did not answer within %.0f s", index, bound)
            elif isinstance(result, BaseException):
                if index in serving:
                    raise result
                logger.warning("abort on replica %d (out of rotation) failed: %s", index, result)

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Refit every replica in rotation (called between pause_for_sync and resume_after_sync)."""
        tensors = list(named_tensors)
        await asyncio.gather(*(self.engines[i].update_weights(iter(tensors), version) for i in self.health.serving()))

    async def resume_after_sync(self, version: int) -> None:
        self.version = version
        outstanding = len(self._inflight) + int(await self.sink.size())
        self.budget.on_sync(outstanding)
        self._open.set()
        self._poke()

    # ------------------------------------------------------------------ state
    def pending_states(self) -> list[dict[str, Any]]:
        """`pending_items` as a checkpoint keeps them: each group in flight with what its responses hold so far."""
        inflight = {uid for uid in self._inflight}
        out = []
        for item in self.pending_items():
            state = asdict(item)
            if item.uid in inflight:
                state["resume"] = self.partials.to_resume(item.uid, item.resume)
            out.append(state)
        return out

    def pending_items(self) -> list[PromptTask]:
        """Prompts taken from the source but not yet in the queue (continued after a resume: `pending_states`)."""
        items = [item for item, _ in self._inflight.values()]
        return items + ([self._next_item] if self._next_item is not None else []) + list(self._retry)

    def unstarted_pending(self) -> int:
        """Pending prompts that `counters.started_groups` does not count (not started, or to retry)."""
        return (self._next_item is not None) + len(self._retry)

    def stop(self) -> None:
        self._stop = True
        self._open.set()
        self._poke()
        for _, task in self._inflight.values():
            task.cancel()


# ---------------------------------------------------------------------- scheduling policies
class PlainPolicy:
    """All `n` responses at once, each on the least loaded replica."""

    def __init__(self, rollouter: Rollouter) -> None:
        self.rollouter = rollouter

    async def generate_group(self, item: PromptTask) -> Optional[list[Response]]:
        ro = self.rollouter
        results = await asyncio.gather(*(ro.generate_response(item, i) for i in range(ro.n)))
        return None if any(r is None for r in results) else list(results)  # type: ignore[arg-type]
