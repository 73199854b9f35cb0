"""The Rollouter actor: owns the data, the engine replicas and the rewards.

`RolloutService` builds the plain `Rollouter` from the config and adds what the
pipeline needs around it: the rollout side of weight sync (one call, verl_async/sync/),
validation (a `Validator`, verl_async/rollout/validation.py, on the same engines and reward
manager: at once while generation is paused, `validate`, or beside the training rollouts,
`start_validation` / `settle_validation` / `take_validations`,
verl_async/rollout/background_validation.py), and the state
that makes a resumed run train every prompt exactly once (dataset cursor + the
prompts that were taken but not yet queued).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from dataclasses import asdict
from typing import Any, Iterable, Mapping, Optional, Sequence

from verl_async.data import Draw, PromptIterator, dataset_from_config
from verl_async.models.loading import run_tokenizer
from verl_async.protocol import Response
from verl_async.reward.manager import build_reward_manager
from verl_async.placement import NodePlan, Reservation, reserve, where
from verl_async.rollout.agent_loop import ToolAgentLoop, reward_extra_info
from verl_async.rollout.background_validation import BackgroundValidation
from verl_async.rollout.engine import InferenceEngine, SamplingParams
from verl_async.rollout.group_filter import GroupFilter
from verl_async.rollout.native.sizing import DEFAULT_MAX_NUM_SEQS
from verl_async.rollout.healing import ReplicaHealer
from verl_async.rollout.partials import model_tokens
from verl_async.rollout.pdsr_policy import max_inflight_groups, scheduling_from_config, scheduling_metrics
from verl_async.rollout.rollouter import PromptTask, Rollouter
from verl_async.rollout.scheduling import policy_class
from verl_async.rollout.side_models import reward_model_scorer, shutdown as shutdown_side_models, teacher_pool
from verl_async.config.derived import (
    colocated_device_ids,
    cpu_threads,
    max_required_samples,
    replica_start_timeout_s,
    required_samples,
    rollout_max_model_len,
    rollout_replicas,
    validation_timeout_s,
)
from verl_async.rollout.validation import Validator
from verl_async.rollout.watchdog import progress_timeout_s
from verl_async.staleness import StalenessBudget
from verl_async.sync import rollout_weight_sync
from verl_async.utils.shared_dirs import SharedDir, verify_here
from verl_async.utils.startup import StartupClock, record_actor
from verl_async.utils.timeline import Timeline
from verl_async.utils.waiting import resolve

logger = logging.getLogger("verl_async.rollout")



def rollout_plan(cfg: Any) -> NodePlan:
    """The replicas' nodes from rollout.nnodes / n_gpus_per_node / node_resource (verl_async/placement.py)."""
    from verl_async.rollout.replica import rollout_node_plan

    return rollout_node_plan(int(cfg.rollout.nnodes), int(cfg.rollout.n_gpus_per_node), str(cfg.trainer.device),
                             int(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size),
                             cfg.rollout.get("node_resource") or None)


class DatasetPromptSource:
    """PromptIterator draws as PromptTasks, with a front buffer for prompts to redo after a resume."""

    def __init__(self, iterator: PromptIterator) -> None:
        self.iterator = iterator
        self._front: collections.deque[PromptTask] = collections.deque()

    @staticmethod
    def task(draw: Draw) -> PromptTask:
        item = draw.item
        return PromptTask(
            uid=draw.uid,  # the one definition of a prompt's exactly-once key (data/dataset.py)
            index=item.index,
            epoch=draw.epoch,
            prompt_ids=list(item.prompt_ids),
            data_source=item.data_source,
            ground_truth=item.ground_truth,
            extra_info=dict(item.extra_info or {}),
            agent_name=item.agent_name,
            messages=[dict(m) for m in (item.messages or [])],
        )

    def next(self) -> Optional[PromptTask]:
        if self._front:
            return self._front.popleft()
        try:
            draw = next(self.iterator)
        except StopIteration:
            return None
        return self.task(draw)

    def push_front(self, items: Sequence[PromptTask]) -> None:
        self._front.extendleft(reversed(list(items)))

    def pending(self) -> list[PromptTask]:
        """Prompts pushed back (after a resume) and not taken again yet: a checkpoint must keep them."""
        return list(self._front)

    def state_dict(self) -> dict:
        return self.iterator.state_dict()


class RewardScorer:
    """Scores a group off the event loop (scorers may be slow or time-bounded in processes)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    async def __call__(self, item: PromptTask, responses: list[Response]) -> list[tuple[float, dict[str, float]]]:
        rewards = await asyncio.to_thread(
            self.manager.score_group,
            [r.token_ids for r in responses],
            item.data_source,
            item.ground_truth,
            item.extra_info,
            [reward_extra_info(item.extra_info, r) for r in responses] if any(r.agent_info for r in responses) else None,
        )
        return [(float(r.reward), dict(r.info)) for r in rewards]


class QueueSink:
    """The MessageQueue actor as the Rollouter's sink (a put waits while the queue is full)."""

    def __init__(self, queue_handle: Any) -> None:
        self.queue = queue_handle

    async def put(self, sample) -> None:
        await self.queue.put.remote(sample)

    async def size(self) -> int:
        return int(await self.queue.size.remote())


def sampling_from(rollout_cfg: Any, eos_ids: Sequence[int], *, validation: bool = False) -> SamplingParams:
    src = rollout_cfg.val_kwargs if validation else rollout_cfg
    do_sample = bool(src.get("do_sample", True))
    temperature = float(src.temperature) if do_sample else 0.0
    return SamplingParams(
        temperature=temperature,
        top_p=float(src.top_p),
        top_k=int(src.top_k),
        max_tokens=int(rollout_cfg.response_length),
        # ignore_eos: the EOS must not stop generation, so it is not a stop id either (only the length ends it)
        stop_token_ids=() if bool(rollout_cfg.get("ignore_eos", False)) else tuple(eos_ids),
        ignore_eos=bool(rollout_cfg.get("ignore_eos", False)),
        seed=int(rollout_cfg.get("seed", 0) or 0),
    )


class RolloutService:
    def __init__(
        self,
        cfg: Any,
        queue_handle: Any,
        *,
        model_path: str,
        run_dir: str,
        run_start: float,
        engines: Optional[Sequence[InferenceEngine]] = None,
        shared_dirs: Sequence[SharedDir] = (),
    ) -> None:
        from verl_async.rollout.replica import ReplicaSpec, await_replicas, kill_replicas, launch_replicas

        self.startup = StartupClock()  # utils/startup.py: the driver writes this lane, this actor its replicas'
        verify_here(shared_dirs, "the Rollouter")
        self.reservation: Optional[Reservation] = None
        self.cfg = cfg
        self.queue = queue_handle
        rollout_cfg = cfg.actor_rollout_ref.rollout
        model_cfg = cfg.actor_rollout_ref.model
        required = required_samples(cfg)
        count = max(1, rollout_replicas(cfg)) if engines is None else len(engines)
        scheduling, scheduling_kwargs, capacities = scheduling_from_config(
            cfg.async_training.get("long_tail"), count, int(rollout_cfg.max_num_seqs or DEFAULT_MAX_NUM_SEQS), required
        )
        # max_num_seqs=null: each native CUDA replica sizes its slots from memory (rollout/native/sizing.py), read back
        sized = rollout_cfg.max_num_seqs is None and scheduling == "plain" and engines is None
        sized = sized and str(cfg.trainer.device) == "cuda" and str(rollout_cfg.name) == "native"
        launched: list[Any] = []
        replica_reports: list[dict] = []  # each engine replica's start-up (utils/startup.py)
        launched_at = time.time()
        clock = self.startup
        try:
            if engines is None:  # the replicas start their processes and load the model while this one loads the rest
                spec = ReplicaSpec(
                    rollout_cfg, model_path, str(cfg.trainer.device),
                    trust_remote_code=bool(model_cfg.trust_remote_code),
                    override_config=dict(model_cfg.override_config or {}),
                    shared_devices=colocated_device_ids(cfg),
                    fail_replicas=cfg.debug.get("fail_replicas"),  # tests and drills (rollout/faults.py)
                    shared_dirs=tuple(shared_dirs),
                    cpu_threads=cpu_threads(cfg),
                )
                if not spec.shared_devices:  # colocated replicas go where the trainer's devices are
                    with clock.phase("reserve"):
                        self.reservation = reserve(rollout_plan(cfg), replica_start_timeout_s(cfg))
                launched_at = time.time()
                launched = launch_replicas(count, spec, engine_overrides=[{"max_num_seqs": None if sized else c}
                                                                          for c in capacities],
                                           placement=self.reservation,
                                           max_restarts=int(cfg.rollout.max_replica_restarts))
            with clock.phase("tokenizer"):
                self.tokenizer = run_tokenizer(model_cfg, model_path)
                self.agent_loop = ToolAgentLoop.from_config(rollout_cfg, self.tokenizer)  # None: single-turn
            tools = self.agent_loop.schemas if self.agent_loop else None
            with clock.phase("data"):
                self.dataset = dataset_from_config(cfg.data, self.tokenizer, "train", tools=tools)
                self.val_dataset = (dataset_from_config(cfg.data, self.tokenizer, "val", tools=tools)
                                    if cfg.data.val_files else None)
            epochs = int(cfg.rollout.total_epochs)
            self.iterator = PromptIterator(self.dataset, shuffle=bool(cfg.data.shuffle), seed=int(cfg.data.seed),
                                           total_epochs=epochs)
            self.source = DatasetPromptSource(self.iterator)
            with clock.phase("reward"):
                self.reward = build_reward_manager(
                    cfg.reward_model, cfg.custom_reward_function, self.tokenizer,
                    max_response_length=int(cfg.data.max_response_length), sandbox_fusion=cfg.reward.sandbox_fusion,
                )
            if engines is None:
                with clock.phase("wait_engines"):  # what the replicas still needed once the above was done
                    engines = await_replicas(launched, replica_start_timeout_s(cfg))  # kills them all when late
                replica_reports = [resolve(h.startup_report.remote(), replica_start_timeout_s(cfg)) for h in launched]
                if sized:
                    capacities = [max(1, e.stats().kv_budget_tokens // max(1, rollout_max_model_len(rollout_cfg) or 1))
                                  for e in engines]
        except BaseException:  # no shutdown() follows a failed start: stop the replicas, give the devices back here
            kill_replicas(launched)
            if self.reservation is not None:
                self.reservation.release()
            raise
        self.engines = list(engines)
        heal = bool(self.engines) and all(hasattr(e, "handle") for e in self.engines)  # replica actors: they restart
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        self.limit = max_required_samples(cfg)
        n = int(rollout_cfg.n)
        total = cfg.rollout.total_rollout_steps
        self.timeline = Timeline(os.path.join(run_dir, "timeline.jsonl"), run_start)
        for i, report in enumerate(replica_reports):
            record_actor(self.timeline, f"replica{i}", launched_at, report)
        self.group_filter = GroupFilter.from_config(cfg.algorithm.get("filter_groups"), required, run_dir)
        with clock.phase("side_models"):  # distillation teachers, reward models: replicas of their own
            self.teachers = teacher_pool(cfg)  # distillation.enabled: the teachers score each finished response
            # reward.reward_model.enable: the model scores each group (with the rule reward when use_task_rewards)
            self.reward_model = reward_model_scorer(cfg, manager=self.reward, rule_scorer=RewardScorer(self.reward),
                                                    policy_tokenizer=self.tokenizer)
        self.scorer = self.reward_model or RewardScorer(self.reward)
        self.rollouter = Rollouter(
            engines=self.engines,
            prompts=self.source,
            scorer=self.scorer,
            sink=QueueSink(queue_handle),
            n=n,
            sampling=sampling_from(rollout_cfg, eos),
            budget=StalenessBudget(self.limit),
            partial_rollout=bool(cfg.async_training.partial_rollout),
            max_inflight_groups=max_inflight_groups(capacities, n, scheduling, scheduling_kwargs),
            total_prompts=None if total in (None, -1) else int(total),
            timeline=self.timeline,
            lengths_log=os.path.join(run_dir, "rollout", "lengths.jsonl"),
            scheduling=policy_class(scheduling),
            scheduling_kwargs=scheduling_kwargs,
            engine_capacity=capacities,
            max_prompt_retries=int(cfg.rollout.max_prompt_retries),
            max_consecutive_engine_failures=int(cfg.rollout.max_consecutive_engine_failures),
            failed_log=os.path.join(run_dir, "rollout", "failed_prompts.jsonl"),
            progress_timeout_s=progress_timeout_s(cfg.rollout.get("progress_timeout_s"), max(capacities),
                                                  int(rollout_cfg.prompt_length), int(rollout_cfg.response_length)),
            group_filter=self.group_filter,
            agent_loop=self.agent_loop,
            response_hook=None if self.teachers is None else self.teachers.annotate,
        )
        self.engines = self.rollouter.engines  # one list: the healer puts a restarted replica's proxy in it
        self.healer: Optional[ReplicaHealer] = None
        if heal:  # rollout/healing.py: a lost replica restarts, gets the current weights alone, rejoins
            self.healer = ReplicaHealer(self.rollouter, max_restarts=int(cfg.rollout.max_replica_restarts),
                                        restart=self._restart_replica, retire=self._end_replica,
                                        needs_weights=not bool(cfg.debug.get("rollout_only")))
            self.rollouter.healer = self.healer
        self._sync_members: Optional[list[int]] = None  # replicas a sync under way reaches (fixed at its pause)
        self.resume_saved_tokens: Optional[int] = None  # resumed: tokens the checkpoint held in flight
        if scheduling != "plain":
            logger.info("rollout scheduling %s %s; replicas: %s", scheduling, scheduling_kwargs,
                        ", ".join(f"{i}:{c} seqs" for i, c in enumerate(capacities)))
        self.validator = None if self.val_dataset is None else Validator(
            self.val_dataset, self.reward, sampling_from(rollout_cfg, eos, validation=True),
            k=int(rollout_cfg.val_kwargs.n), max_num_seqs=max(capacities), timeline=self.timeline,
            timeout_s=validation_timeout_s(cfg, len(self.val_dataset)),
            log_generations=int(cfg.trainer.log_val_generations), agent_loop=self.agent_loop,
            engine_busy=self.rollouter.engine_busy,
        )
        self.background = BackgroundValidation(self.validate)  # trainer.val_async
        self._run_started = time.monotonic()

    # ------------------------------------------------------------------ the loop
    async def run(self) -> dict:
        """Generate until the data ends; then close the queue so the trainer drains and stops."""
        try:
            counters = await self.rollouter.run()
        finally:
            await self.queue.close.remote()
        out: dict[str, Any] = asdict(counters)
        out["replicas_out"] = {str(i): why for i, why in sorted(self.rollouter.health.out.items())}
        if self.healer is not None:
            out["replica_heals"] = self.healer.summary()
        if self.resume_saved_tokens is not None:
            out["resume"] = {"saved_tokens": self.resume_saved_tokens, "continued_tokens": counters.resume_continued_tokens,
                             "continued_responses": counters.resume_continued_responses,
                             "regenerated_tokens": counters.resume_regenerated_tokens}
        if self.group_filter is not None:
            out["filtered_groups"] = self.group_filter.filtered
        out.update(self.reward.summary())  # reward_scored, reward_errors (the end-of-run summary)
        out["engine_profile"] = await self._engine_profile()
        return out

    async def _engine_profile(self) -> dict[str, float]:
        """The replicas' step counters, summed (prefill vs decode seconds: what a sync's re-prefill costs)."""
        total: dict[str, float] = {}
        for engine in self.engines:
            handle = getattr(engine, "handle", None)
            try:
                if handle is not None:
                    profile = await asyncio.wait_for(handle.profile.remote(), timeout=30)
                else:
                    profile = dict(getattr(engine, "profile", dict)())
            except Exception as exc:  # noqa: BLE001 - a dead replica has no counters; the run's outcome stands
                logger.warning("engine profile unavailable: %s", exc)
                continue
            for key, value in profile.items():
                if isinstance(value, (int, float)) and not key.endswith(("_bytes", "bytes_per_token")):
                    total[key] = total.get(key, 0.0) + float(value)
        return total

    def stop(self) -> None:
        self.rollouter.stop()

    async def shutdown(self) -> None:
        """Stop generating and end the engine replicas."""
        import ray

        self.rollouter.stop()
        if self.healer is not None:
            self.healer.close()
        for engine in self.engines:
            handle = getattr(engine, "handle", None)
            try:
                await engine.shutdown()
            except Exception:  # noqa: BLE001 - a dead replica needs no shutdown
                pass
            if handle is not None:
                ray.kill(handle)
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None
        if self.teachers is not None:
            shutdown_side_models(self.teachers.replicas)
        if self.reward_model is not None:
            shutdown_side_models(self.reward_model.actors)
        self.reward.close()

    def placement(self) -> str:
        """Where the engine replicas run ("" when Ray placed them: colocated, or engines given)."""
        return "" if self.reservation is None else where("replicas", self.reservation.member_nodes())

    def startup_report(self) -> dict[str, Any]:
        """This actor's start-up phases (utils/startup.py); its replicas' lanes are in the timeline already."""
        return self.startup.report()

    def total_prompts(self) -> int:
        """Prompts this run will generate (rollout.total_rollout_steps, else epochs x dataset)."""
        epochs_total = len(self.dataset) * int(self.cfg.rollout.total_epochs)
        limit = self.rollouter.total_prompts
        return epochs_total if limit is None else min(limit, epochs_total)

    # ------------------------------------------------------------------ sync
    async def pause_for_sync(self) -> None:
        await self.rollouter.pause_for_sync()
        if self.healer is not None:  # restarted replicas waiting for weights get this sync's too, then rejoin
            self._sync_members = sorted(set(self.rollouter.health.serving()) | set(self.healer.awaiting_weights()))

    async def resume_after_sync(self, version: int) -> None:
        members, self._sync_members = self._sync_members, None
        for index in members or []:
            if self.healer is not None and index in self.healer.awaiting:
                await self.healer.rejoin(index, version)
        await self.rollouter.resume_after_sync(version)

    async def weight_sync(self, transport: str, step: str, *args: Any, **kwargs: Any) -> Any:
        """The one call weight sync makes on the rollout side: `step` of `transport`, fanned out to the replicas."""
        return await rollout_weight_sync(self, transport, step, *args, **kwargs)

    @property
    def sync_engines(self) -> list[InferenceEngine]:
        """The replicas weight sync reaches: those in rotation (one taken out may be broken or dead), and those that
        restarted and wait for weights (fixed when the sync paused generation)."""
        if self._sync_members is None:
            return [self.engines[i] for i in self.rollouter.health.serving()]
        healer = self.healer
        return [healer.engine_of(i) if healer is not None and i in healer.awaiting else self.engines[i]
                for i in self._sync_members]

    def member_lost(self, engine: Any, exc: Exception) -> None:
        """A replica died in a sync step (sync/ports.py): out of this sync, healed; the others' load goes on."""
        index = int(getattr(engine, "index", -1))
        if self._sync_members is not None and index in self._sync_members:
            self._sync_members.remove(index)
        reason = getattr(exc, "reason", str(exc))
        if self.healer is not None and index in self.healer.awaiting:
            self.healer.lost_awaiting(index, engine, f"lost while loading weights: {reason}")
        else:
            self.rollouter.replica_lost(index, reason, engine=engine)

    # ------------------------------------------------------------------ healing (rollout/healing.py)
    async def _restart_replica(self, index: int, engine: Any, kill: bool) -> Any:
        from verl_async.rollout.replica import restart_replica

        return await restart_replica(engine, kill=kill, timeout_s=replica_start_timeout_s(self.cfg))

    def _end_replica(self, index: int, engine: Any) -> None:
        from verl_async.rollout.replica import end_replica

        end_replica(engine)

    def replicas_awaiting_weights(self) -> dict[str, Any]:
        """Restarted replicas waiting for the current weights, and how many serve (Trainer.serve_replica_heals)."""
        awaiting = [] if self.healer is None else self.healer.awaiting_weights()
        return {"awaiting": awaiting, "serving": len(self.rollouter.health.serving()), "version": self.rollouter.version}

    def heal_begin(self, version: int) -> list[int]:
        """The trainer pushes `version` to the replicas that wait now (no pause: the others keep generating)."""
        return [] if self.healer is None else self.healer.begin_push(version)

    async def heal_load(self, refs: list, version: int) -> None:
        """One object-store bucket of that push, to each waiting replica alone."""
        if self.healer is not None:
            await self.healer.push_bucket(lambda e: e.weight_sync("object_store", "load", list(refs), version=version))

    async def heal_end(self, version: int) -> int:
        """Replicas whose every parameter this push wrote rejoin; returns how many."""
        if self.healer is None:
            return 0

        async def complete(engine: Any) -> bool:
            return not await engine.weight_sync("object_store", "unwritten", version=version)

        return await self.healer.end_push(complete)

    def release_budget(self, groups: int) -> None:
        self.rollouter.release_budget(groups)

    def oldest_inflight_version(self) -> Optional[int]:
        """For `trainer.v1.sampler.max_off_policy_strategy=wait` (verl_async/off_policy.py)."""
        return self.rollouter.oldest_inflight_version()

    def budget_stall(self) -> dict[str, float]:
        """How long the Rollouter has idled on its staleness budget (the trainer's deadlock check)."""
        ro = self.rollouter
        return {"idle_s": ro.idle_on_budget_s(), "started": float(ro.budget.started), "limit": float(ro.budget.limit),
                "version": float(ro.version)}

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        c = self.rollouter.counters
        wall = max(1e-9, time.monotonic() - self._run_started)
        out = {f"rollout/{k}": float(v) for k, v in asdict(c).items() if not k.startswith("resume_")}
        if self.resume_saved_tokens is not None:  # resumed from a checkpoint: what it held in flight, continued
            out.update({"resume/saved_tokens": float(self.resume_saved_tokens),
                        "resume/continued_tokens": float(c.resume_continued_tokens),
                        "resume/continued_responses": float(c.resume_continued_responses),
                        "resume/regenerated_tokens": float(c.resume_regenerated_tokens)})
        # no request of any kind (generation or validation) on any engine
        out["rollout/idle_ratio"] = max(0.0, 1.0 - self.rollouter.engine_busy.seconds() / wall)
        out["rollout/tokens_per_s"] = c.generated_tokens / wall
        out["rollout/inflight_groups"] = float(len(self.rollouter._inflight))
        out["rollout/staleness_budget_left"] = float(self.rollouter.budget.remaining)
        out.update(scheduling_metrics(self.rollouter, wall))
        if self.teachers is not None:
            out.update(self.teachers.metrics())
        if self.reward_model is not None:
            out.update(self.reward_model.metrics())
        if self.group_filter is not None:
            out.update(self.group_filter.metrics())
        if self.agent_loop is not None:
            out.update(self.agent_loop.stats.metrics())
        out.update(self.reward.metrics())
        if self.healer is not None:
            out.update(self.healer.metrics())
        stats = self.dataset.stats
        out["data/bad_rows"] = float(stats.bad_rows)
        out["data/filtered_overlong"] = float(stats.filtered_overlong)
        return out

    # ------------------------------------------------------------------ validation
    async def validate(self, version: int) -> dict[str, Any]:
        """val/* metrics on data.val_files ({} without them), on the replicas in rotation (all when none is).

        With trainer.log_val_generations=N also N samples under VAL_GENERATIONS_KEY (Validator.run).
        """
        if self.validator is None:
            return {}
        return await self.validator.run(self._validation_engines(), version)

    def _validation_engines(self) -> list[InferenceEngine]:
        return [self.engines[i] for i in self.rollouter.health.serving()] or self.engines

    async def start_validation(self, version: int) -> bool:
        """Validate `version` beside the training rollouts (trainer.val_async); False without data.val_files."""
        if self.validator is None:
            return False
        self.background.start(version)
        return True

    async def settle_validation(self) -> list[dict[str, Any]]:
        """Wait for the validation still running (a sync calls this before moving weights); every outcome not taken.

        Each outcome: {version, metrics, error, fatal, seconds} (background_validation.ValidationOutcome).
        """
        return [o.to_dict() for o in await self.background.settle()]

    def take_validations(self) -> list[dict[str, Any]]:
        """The validations finished since the last call (the trainer polls every step), as `settle_validation`."""
        return [o.to_dict() for o in self.background.take()]

    async def cancel_validation(self) -> Optional[int]:
        """Give up on the running validation (the trainer stopped waiting, or died): cancel it, abort its requests;
        the version it validated (None: none ran)."""
        version = await self.background.cancel()
        if version is not None and self.validator is not None:
            await self.validator.abort(self._validation_engines(), version)
        return version

    def validation_timeout_s(self) -> float:
        """How long one validation may take (0 without data.val_files): the Trainer waits that long."""
        return 0.0 if self.validator is None else self.validator.timeout_s

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        """Cursor + prompts taken but not queued yet (call while paused for a sync).

        Pending holds the groups in flight, the prompts waiting to start or to be retried,
        and those pushed back by an earlier resume that have not started again. Only started
        ones are in `started_groups`; it is saved as if all pending had started, because
        `load_state_dict` subtracts every prompt it pushes back. Groups that `algorithm.filter_groups`
        dropped are consumed: behind the cursor, not pending, and counted in `filtered`.
        """
        ro = self.rollouter
        unstarted = self.source.pending()
        pending = ro.pending_states() + [asdict(t) for t in unstarted]  # in flight: with their partial responses
        return {
            "iterator": self.iterator.state_dict(),
            "pending": pending,
            "version": ro.version,
            "started_groups": ro.counters.started_groups + ro.unstarted_pending() + len(unstarted),
            "filtered": self.group_filter.state_dict() if self.group_filter is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any], queued_uids: Iterable[str] = ()) -> int:
        """Continue at the checkpointed cursor; redo pending prompts that are not already queued."""
        self.iterator.load_state_dict(state["iterator"])
        skip = set(queued_uids)
        redo = [PromptTask(**p) for p in state.get("pending", []) if p["uid"] not in skip]
        self.source.push_front(redo)
        self.resume_saved_tokens = sum(model_tokens(s) for t in redo for s in t.resume.values())
        self.rollouter.version = int(state.get("version", 0))
        # total_rollout_steps counts over the whole run: the redone prompts start again
        self.rollouter.counters.started_groups = int(state.get("started_groups", 0)) - len(redo)
        if self.group_filter is not None:
            self.group_filter.load_state_dict(state.get("filtered") or {})
        return len(redo)
