"""The Trainer: groups from the queue in, policy updates out, weights back every k steps.

Per step it takes `required_samples = ppo_mini_batch_size * require_batches` complete
groups, builds the train batch, prepares it (`trainer/prepare.py`: old and reference
log-probs, KL, advantages, rollout-correction weights and loss mask) and runs the
worker group's update. Every `trigger_parameter_sync_step` steps it pushes the weights
(version += 1) and checkpoints every `save_freq` versions while generation is paused, so that a
checkpoint is a consistent cut of (trainer weights, dataset cursor, queued groups, in-flight
prompts). Every `test_freq` versions it validates: with `trainer.val_async=true` (default) the
validation starts once generation resumes and runs beside training on the engines; its metrics
are logged at the step of the version they validate when they arrive (polled every step), and
the next sync waits for it before moving weights, so that it stays on one version
(rollout/background_validation.py). With `false` it runs while generation is paused and the
trainer waits. A checkpoint never depends on a validation: it is written first, and a
validation that fails or times out (`trainer.val_timeout_s`) is logged and training goes on.

A plain class: the recipe wraps it in a threaded Ray actor (so `progress()` and
`stop()` answer while `run()` works); tests may drive it in-process.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import ray
import torch
from omegaconf import OmegaConf

from verl_async.config.derived import required_samples
from verl_async.config.resume import run_facts
from verl_async.config.verl_v1 import off_policy_wait, oldest_first
from verl_async.protocol import RolloutSample, collate_groups
from verl_async.off_policy import must_wait, trajectory_metrics
from verl_async.staleness import exceeds_max_staleness
from verl_async.sync import TIMEOUT_KEY as SYNC_TIMEOUT_KEY
from verl_async.sync import build_sync_from_config, sync_timeout_s
from verl_async.trainer.faults import die_in_sync
from verl_async.trainer.prepare import StepAlgorithm, prepare_batch, update_input
from verl_async.trainer.settings import WORKER_TIMEOUT_S
# format_validation and VALIDATION_GRACE_S are imported from here by the pipeline and the tests
from verl_async.trainer.validation import VALIDATION_GRACE_S, TrainerValidation, format_validation  # noqa: F401
from verl_async.utils.timeline import Timeline
from verl_async.utils.tracking import Tracker
from verl_async.utils.waiting import get_within

if TYPE_CHECKING:  # tensordict (and torch._dynamo under it) loads with the first batch, not at start-up
    from tensordict import TensorDict

logger = logging.getLogger("verl_async.trainer")

QUEUE_POLL_S = 2.0
# The trainer waiting for groups while the Rollouter idles on its staleness budget, both this
# long, is a deadlock (only the trainer's next sync frees the budget): an error, not a hang.
STALL_LIMIT_S = 60.0


class DeadlockError(RuntimeError):
    """The trainer waits for groups that the Rollouter may not start before the next sync."""


# What the console logger prints per step (TensorBoard gets everything).
CONSOLE_KEYS = (
    "critic/score/mean", "critic/acc/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm",
    "actor/entropy", "fully_async/staleness/mean", "fully_async/queue_size", "timing_s/step",
    "timing_s/param_sync", "perf/trained_tokens_per_s", "fully_async/trainer_idle_ratio", "rollout/idle_ratio",
    "val/mean@1/acc", "mismatch/train_rollout_logprob_abs_diff", "critic/nonzero_adv_frac",
    "fully_async/filtered_groups",
)


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


def batch_metrics(groups: Sequence[RolloutSample], version: int, max_response_length: int) -> dict[str, float]:
    """Reward, accuracy, length and staleness of the groups a step trains on."""
    responses = [r for g in groups for r in g.responses]
    rewards = [r.reward for r in responses]
    lengths = [len(r) for r in responses]
    stale = [version - g.min_version for g in groups]
    out = {
        "critic/score/mean": _mean(rewards),
        "critic/score/max": float(max(rewards)) if rewards else 0.0,
        "critic/score/min": float(min(rewards)) if rewards else 0.0,
        # verl's rewards: the score as trained (trainer/prepare.py replaces them with the KL-shaped ones when
        # algorithm.use_kl_in_reward subtracts the KL)
        "critic/rewards/mean": _mean(rewards),
        "critic/rewards/max": float(max(rewards)) if rewards else 0.0,
        "critic/rewards/min": float(min(rewards)) if rewards else 0.0,
        "response_length/mean": _mean(lengths),
        "response_length/max": float(max(lengths)) if lengths else 0.0,
        "response_length/min": float(min(lengths)) if lengths else 0.0,
        "response_length/clip_ratio": _mean([float(r.finish_reason == "length") for r in responses]),
        "prompt_length/mean": _mean([len(g.prompt_ids) for g in groups]),
        "fully_async/staleness/mean": _mean(stale),
        "fully_async/staleness/max": float(max(stale)) if stale else 0.0,
        "fully_async/partial_responses": float(sum(r.min_version != r.max_version for r in responses)),
    }
    accs = [r.reward_info["acc"] for r in responses if "acc" in r.reward_info]
    if accs:
        out["critic/acc/mean"] = _mean(accs)
    return out


class Trainer(TrainerValidation):
    def __init__(
        self,
        cfg: Any,
        queue: Any,
        rollouter: Any,
        *,
        run_dir: str,
        run_start: float,
        pad_token_id: Optional[int],
        worker_group: Any = None,
        group_source: Optional[Callable[[int], Optional[list[RolloutSample]]]] = None,
        console_sink: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.cfg = cfg
        self.call_timeout_s = float(cfg.trainer.get("worker_timeout_s", WORKER_TIMEOUT_S))
        self.queue = queue
        self.rollouter = rollouter
        self.run_dir = run_dir
        self.pad_token_id = pad_token_id  # None: the driver sends it before training (TrainerHost.set_pad_token_id)
        self.wg = worker_group
        self.group_source = group_source  # debug.load_rollout_data
        self.required = required_samples(cfg)
        self.trigger = int(cfg.async_training.trigger_parameter_sync_step)
        self.n = int(cfg.actor_rollout_ref.rollout.n)
        self.max_staleness = cfg.algorithm.get("max_staleness")
        self.off_policy_wait = off_policy_wait(cfg)  # V1 max_off_policy_strategy=wait: the span it waits at
        self.oldest_first = oldest_first(cfg)  # V1's sampler order
        self.kl_coef = float(cfg.algorithm.kl_ctrl.kl_coef)  # in-reward KL; moves with kl_ctrl.type=adaptive
        self.algorithm = StepAlgorithm.from_config(cfg)
        self.test_freq = int(cfg.trainer.test_freq or -1)
        self.save_freq = int(cfg.trainer.save_freq or -1)
        self.max_steps = int(cfg.trainer.get("total_training_steps") or 0)  # 0: until the data ends
        self._ended_at_cap = False  # synced and checkpointed at the cap already: finish() only validates
        self.timeline = Timeline(os.path.join(run_dir, "timeline.jsonl"), run_start)
        self.tracker = Tracker(
            cfg.trainer.logger, os.path.join(run_dir, "tensorboard"),
            project=str(cfg.trainer.project_name), experiment=str(cfg.trainer.experiment_name),
            config=OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else None,
            console_keys=CONSOLE_KEYS, file_path=os.path.join(run_dir, "metrics.jsonl"), console_sink=console_sink,
        )
        self.version = 0
        self.step = 0
        self.local_updates = 0  # optimizer steps since the last push: the engines do not have these weights yet
        self.start_step = 0  # the step restore() resumed at: this process trains steps start_step+1 ...
        # the trainer step at which each weight version was made: the x of its validation (metrics go by step)
        self._version_step: dict[int, int] = {0: 0}
        self._wait_this_step = 0.0  # seconds the last _next_groups waited (verl's timing_s/gen)
        self.resumed_from: Optional[str] = None
        self.dropped_stale = 0
        self.trained_tokens = 0
        self.wait_s = 0.0
        self.started = time.monotonic()
        self.last: dict[str, float] = {}
        self.fault_metrics: dict[str, float] = {}  # fault/trainer_* once this Trainer replaced one that died
        self._init_validation(cfg)
        self._say = console_sink or print  # the driver's console: the validation before training's line
        self._stop = threading.Event()
        self._trained_log = os.path.join(run_dir, "trained_uids.jsonl")
        self.sync = None
        if worker_group is not None and rollouter is not None:
            self.sync = build_sync_from_config(cfg, worker_group, rollouter)

    def _call(self, ref: Any, what: str, extra_s: float = 0.0) -> Any:
        """The answer of one call to the queue or the Rollouter within trainer.worker_timeout_s (+ `extra_s` the call
        itself waits), or a KeyedTimeout naming that key: a stuck actor fails the run instead of hanging it."""
        return get_within(ref, self.call_timeout_s + extra_s, what, "trainer.worker_timeout_s")

    # ------------------------------------------------------------------ resume
    def find_checkpoint(self) -> Optional[str]:
        from verl_async.config.resume import checkpoint_to_resume
        from verl_async.checkpoint import recover_interrupted_publish

        if str(self.cfg.trainer.resume_mode) == "auto":
            for move in recover_interrupted_publish(str(self.cfg.trainer.default_local_dir)):  # a kill in a publish
                logger.warning("finished an interrupted checkpoint publish: %s", move)
        return checkpoint_to_resume(self.cfg.trainer)

    def resume_point(self) -> dict[str, Any]:
        """The checkpoint restore() loaded (None: started fresh) and the step this process started at."""
        return {"path": self.resumed_from, "step": self.start_step}

    def restore(self) -> int:
        """Load the latest (or given) checkpoint: weights, queue, cursor; returns the version to push."""
        path = self.find_checkpoint() if self.wg is not None else None
        if not path:
            open(self._trained_log, "w").close()
            return 0
        extra = self._load(path)
        self.resumed_from, self.start_step = path, self.step
        queued = extra.get("queue", [])
        self._call(self.queue.restore.remote(queued, path), "the queue's restore")
        redo = 0
        if self.rollouter is not None and extra.get("rollouter") is not None:
            redo = self._call(self.rollouter.load_state_dict.remote(extra["rollouter"], [g["uid"] for g in queued]),
                              "the Rollouter's restore")
        elif self.rollouter is not None:  # written by a train-only run (debug.load_rollout_data)
            logger.warning("%s holds no Rollouter state (a train-only checkpoint): the data starts at its beginning",
                           path)
        logger.info("resumed from %s: version %d, step %d, %d queued groups, %d prompts to continue",
                    path, self.version, self.step, len(queued), redo)
        return self.version

    def restore_after_restart(self, path: Optional[str], start_step: int) -> int:
        """The trainer side restarted (healing/trainer.py): the weights and counters of `path` (None: the model as
        the run started), nothing else. The queue (rewound to that checkpoint) and the Rollouter lived on; their
        groups count against it. `start_step`: where this run's process started (the summary counts from there)."""
        if path:
            self._load(path)
        else:
            self.version, self.step = 0, 0
        self.start_step = int(start_step)
        self.resumed_from = path
        return self.version

    def _load(self, path: str) -> dict:
        extra = self.wg.load(path)
        self.version, self.step = int(extra["version"]), int(extra["step"])
        self._version_step = {self.version: self.step}
        self.tracker.resume(self.step)  # what the abandoned process logged after this step goes (docs/log_formats.md)
        if str(self.cfg.algorithm.kl_ctrl.type) == "adaptive":  # fixed: the configured value, even if changed
            self.kl_coef = float(extra.get("kl_coef", self.kl_coef))
        self._truncate_trained_log(self.step)
        return extra

    def note_restart(self, restarts: int, recovery_s: float) -> None:
        """This Trainer replaced one that died (healing/trainer.py): its metrics say so (fault/trainer_*)."""
        self.fault_metrics = {"fault/trainer_restarts": float(restarts), "fault/trainer_recovery_s": float(recovery_s)}

    def _truncate_trained_log(self, step: int) -> None:
        """Keep the record of the `step` steps the checkpoint holds; later ones were lost with the crash."""
        if not os.path.exists(self._trained_log):
            return
        with open(self._trained_log) as f:
            keep = [line for line in f if line.strip() and json.loads(line)["step"] < step]
        with open(self._trained_log, "w") as f:
            f.writelines(keep)

    # ------------------------------------------------------------------ the loop
    def progress(self) -> dict[str, float]:
        return {"step": self.step, "version": self.version, **self.last}

    def stop(self) -> None:
        self._stop.set()

    def push_weights(self, with_hooks: bool = True) -> dict[str, float]:
        """Sync weights at the current version: a validation still running ends first, the checkpoint (and with
        val_async=false the validation) happens while generation is paused; a due validation starts after."""
        self.local_updates = 0  # (a failed push ends the run) the engines get the trainer's weights as they are
        if self.sync is None:
            if self.rollouter is not None:  # rollout-only: no weights, just reopen the budget
                get_within(self.rollouter.resume_after_sync.remote(self.version), sync_timeout_s(self.cfg),
                           "the Rollouter's resume after a sync", SYNC_TIMEOUT_KEY)
            # train-only (debug.load_rollout_data): no engines to sync, but checkpoints are due as in any run
            return self._while_paused() if with_hooks and self.wg is not None else {}
        with self.timeline.span("sync", "sync", self.version):
            out = self.sync.push(self.version, self._while_paused if with_hooks else None,
                                 before_transfer=self.settle_validation)
        if with_hooks and self.val_async and self._validation_due():
            self._start_validation()
        return out

    def _while_paused(self) -> dict[str, float]:
        """Checkpoint, then (val_async=false) validate: the checkpoint never waits on (or is lost with) a validation."""
        die_in_sync(self.cfg, self.version)  # debug.fail_trainer's actor:die@sync<V> (fault drills)
        out: dict[str, float] = {}
        if self.save_freq > 0 and self.version % self.save_freq == 0 and self.version > 0:
            out["timing_s/save_checkpoint"] = self.save_checkpoint()
        if not self.val_async and self._validation_due():
            self.validate()  # logs its own metrics at this version
        return out

    def save_checkpoint(self, finished: bool = False) -> float:
        """Weights, queue, cursor and the run's facts; `finished`: the run ended here (a re-run exits at once)."""
        t0 = time.perf_counter()
        # The Rollouter's pending prompts first, then the queue: a group put between the two calls
        # is then in both (load_state_dict skips pending uids found in the queue), never in neither.
        rollouter_state = None if self.rollouter is None else self._call(self.rollouter.state_dict.remote(),
                                                                         "the Rollouter's checkpoint state")
        extra = {
            "version": self.version,
            "step": self.step,
            "kl_coef": self.kl_coef,
            "queue": self._call(self.queue.snapshot.remote(), "the queue's checkpoint snapshot"),
            "rollouter": rollouter_state,
        }
        prompts = (rollouter_state or {}).get("iterator", {}).get("num_items")
        info = run_facts(self.cfg, self.step, self.version, prompts, finished=finished)  # what a resume checks
        path = self.wg.save_checkpoint(str(self.cfg.trainer.default_local_dir), extra, step=self.version, info=info)
        # the groups taken so far are in it: a trainer restart rewinds the queue to here (healing/trainer.py)
        self._call(self.queue.checkpointed.remote(path), "the queue's checkpoint mark")
        return time.perf_counter() - t0

    def serve_replica_heals(self) -> None:
        """Restarted engine replicas wait for the current weights (rollout/healing.py): while the trainer waits for
        groups anyway and its weights are the engines' version, it pushes them to those replicas alone. When none
        serves and its weights are ahead of the engines' (between syncs), no group can come before a sync: it syncs."""
        if self.sync is None or self.rollouter is None:
            return
        state = self._call(self.rollouter.replicas_awaiting_weights.remote(), "the Rollouter's healing state")
        if not state["awaiting"]:
            return
        if self.step % self.trigger == 0:  # right after a sync: these weights are the version the engines hold
            from verl_async.sync.object_store import push_to_waiting_replicas

            t0 = time.perf_counter()
            joined = push_to_waiting_replicas(self.wg, self.rollouter, self.version,
                                              int(self.cfg.async_training.sync_bucket_size_mb) << 20, self._call)
            logger.warning("pushed version %d to restarted engine replica(s) %s in %.1f s; %d rejoined", self.version,
                           state["awaiting"], time.perf_counter() - t0, joined)
        elif not state["serving"]:
            logger.warning("no engine replica serves and replica(s) %s wait for weights: syncing version %d early",
                           state["awaiting"], self.version + 1)
            self.version += 1
            self.push_weights()

    def _next_groups(self) -> list[RolloutSample]:
        """Block for `required` groups; [] when the rollouter is done and the queue drained."""
        if self.group_source is not None:
            return self.group_source(self.step) or []
        t0 = time.monotonic()
        start = self.timeline.now()
        order = {"oldest_first": True} if self.oldest_first else {}
        try:
            self._wait_off_policy()
            while not self._stop.is_set():
                self.serve_replica_heals()
                try:
                    return self._call(self.queue.get_batch.remote(self.required, QUEUE_POLL_S, **order),
                                      "the queue's get_batch",
                                      extra_s=QUEUE_POLL_S)  # the queue answers TimeoutError after QUEUE_POLL_S
                except ray.exceptions.RayTaskError as exc:
                    if isinstance(exc.cause, TimeoutError) or "TimeoutError" in str(exc):
                        self._check_deadlock(time.monotonic() - t0)
                        if self._val_before is not None:  # its line when it ends, not after the first step
                            self.collect_validations()
                        continue
                    raise
            return []
        finally:
            self._wait_this_step = time.monotonic() - t0
            self.wait_s += self._wait_this_step
            self.timeline.record("trainer/driver", "wait", start, self.timeline.now(), self.version)

    def _wait_off_policy(self) -> None:
        """V1 `max_off_policy_strategy=wait`: while a group in flight has spanned the threshold, let it finish
        (it is then trained first, oldest_first) instead of dropping it. The Rollouter's progress watchdog
        bounds the wait (a wedged engine fails the run)."""
        if self.off_policy_wait is None or self.rollouter is None:
            return
        logged = False
        while not self._stop.is_set():
            oldest = self._call(self.rollouter.oldest_inflight_version.remote(), "the Rollouter's oldest group")
            if not must_wait(self.version, oldest, self.off_policy_wait):
                return
            if not logged:
                logger.info("version %d: waiting for the groups admitted under version %s (trainer.v1.sampler."
                            "max_off_policy_threshold=%d, strategy wait)", self.version, oldest, self.off_policy_wait)
                logged = True
            time.sleep(QUEUE_POLL_S / 4)

    def _check_deadlock(self, waited_s: float) -> None:
        """Raise when neither side can move (a staleness slot that never came back); see STALL_LIMIT_S."""
        if self.rollouter is None or waited_s < STALL_LIMIT_S:
            return
        stall = self._call(self.rollouter.budget_stall.remote(), "the Rollouter's budget state")
        if stall["idle_s"] < STALL_LIMIT_S:
            return
        raise DeadlockError(
            f"the trainer has waited {waited_s:.0f} s for {self.required} groups while the Rollouter, with no group "
            f"in flight, has waited {stall['idle_s']:.0f} s on its staleness budget ({stall['started']:.0f} of "
            f"{stall['limit']:.0f} groups started under version {stall['version']:.0f}); only the next weight sync "
            f"frees it (groups dropped by algorithm.max_staleness so far: {self.dropped_stale})"
        )

    def run(self) -> dict[str, Any]:
        """Train until the rollouter is done or `trainer.total_training_steps` is reached; returns a summary."""
        while not self._stop.is_set():
            if self.max_steps and self.step >= self.max_steps:
                self._end_at_cap()
                break
            groups = self._next_groups()
            if not groups:
                break
            groups = self._drop_too_stale(groups)
            if not groups:
                continue
            metrics = self.train_step(groups)
            self.step += 1
            if self.step % self.trigger == 0:
                self._next_version()
                metrics.update(self.push_weights())
            metrics.update(self._pipeline_metrics())
            metrics["training/global_step"] = float(self.step)
            self.last = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            self.tracker.log(metrics, step=self.step)  # x = trainer step (verl's), fully_async/param_version beside it
            self.collect_validations()
        return self.summary()

    def _next_version(self) -> None:
        self.version += 1
        self._version_step[self.version] = self.step

    def _end_at_cap(self) -> None:
        """`trainer.total_training_steps` reached: checkpoint while the Rollouter still runs, then stop it.

        The checkpoint comes first so that it records the prompts in flight and the groups in the
        queue as pending (as any mid-run checkpoint does): a resume with a larger cap regenerates
        them, exactly once. Stopping first would cancel them before they were recorded.
        """
        if self.wg is not None and self.step % self.trigger != 0:  # the last updates are not on the engines yet
            self._next_version()
            self.push_weights(with_hooks=False)
        if self.save_freq > 0 and self.step > self.start_step:
            self.save_checkpoint(finished=True)
        self._ended_at_cap = True
        if self.rollouter is not None:
            self._call(self.rollouter.stop.remote(), "the Rollouter's stop")

    def finish(self) -> dict[str, float]:
        """After the last step: wait for a validation still running, put the final weights on the engines,
        checkpoint, then validate (test_freq > 0; the last version's own validation when it had one)."""
        self.settle_validation()
        if self.wg is None:
            return {}
        if self.step % self.trigger != 0 and not self._ended_at_cap:  # the last updates are not on the engines yet
            self._next_version()
            self.push_weights(with_hooks=False)
        if self.save_freq > 0 and self.step > 0 and not self._ended_at_cap:
            self.save_checkpoint(finished=not self._stop.is_set())  # the data ended: a re-run has nothing to train
        if self.test_freq <= 0:
            return {}
        last = self.val_history[-1] if self.val_history else None
        if last is not None and last["version"] == self.version:  # test_freq divides the last version
            return {k: v for k, v in last.items() if k != "version"}
        return self.validate()

    def close(self) -> None:
        self.tracker.close()

    def summary(self) -> dict[str, Any]:
        wall = time.monotonic() - self.started
        return {
            "steps": self.step,
            "start_step": self.start_step,  # > 0: resumed; steps - start_step ran in this process
            "version": self.version,
            "trained_tokens": self.trained_tokens,
            "wall_s": wall,
            "trainer_idle_ratio": self.wait_s / max(wall, 1e-9),
            "dropped_stale_groups": self.dropped_stale,
            "validation": self.val_history,
            "validation_failures": self.val_failures,
            "val_before": self.val_before,  # the validation before training that ran beside it (val_async)
        }

    def _drop_too_stale(self, groups: list[RolloutSample]) -> list[RolloutSample]:
        keep = [g for g in groups if not exceeds_max_staleness(self.version, g.min_version, self.max_staleness)]
        dropped = len(groups) - len(keep)
        if dropped:
            self.dropped_stale += dropped
            logger.warning("dropped %d groups older than algorithm.max_staleness=%s", dropped, self.max_staleness)
            if self.rollouter is not None:  # their staleness slots go back: replacements can be generated
                self._call(self.rollouter.release_budget.remote(dropped), "the Rollouter's budget release")
        return keep

    def _pipeline_metrics(self) -> dict[str, float]:
        wall = max(time.monotonic() - self.started, 1e-9)
        out = {
            "fully_async/param_version": float(self.version),
            "fully_async/trainer_idle_ratio": self.wait_s / wall,
            "fully_async/dropped_stale_groups": float(self.dropped_stale),
            "perf/trained_tokens_per_s": self.trained_tokens / wall,
            **self.fault_metrics,
        }
        if self.queue is not None:
            stats = self._call(self.queue.stats.remote(), "the queue's stats")
            out["fully_async/queue_size"] = float(stats.size)
            out["fully_async/queue_produced"] = float(stats.produced)
        if self.rollouter is not None:
            out.update(self._call(self.rollouter.metrics.remote(), "the Rollouter's metrics"))
        return out

    # ------------------------------------------------------------------ one step
    def train_step(self, groups: list[RolloutSample]) -> dict[str, float]:
        t0 = time.perf_counter()
        step_start = self.timeline.now()
        for g in groups:
            g.validate(self.n)
        if self.pad_token_id is None:
            raise RuntimeError("the Trainer has no pad token id: the driver sends it (set_pad_token_id) before training")
        batch = collate_groups(groups, self.pad_token_id)
        metrics = batch_metrics(groups, self.version, int(self.cfg.data.max_response_length))
        metrics.update(trajectory_metrics(groups, self.version))  # verl V1's training/off_policy/* beside ours
        self._save_rollout_data(groups)
        with open(self._trained_log, "a") as f:
            f.write(json.dumps({"step": self.step, "version": self.version, "uids": [g.uid for g in groups]}) + "\n")
        if self.wg is None:  # rollout-only
            return metrics
        prepared, self.kl_coef = prepare_batch(batch, self.algorithm, self.wg, self.kl_coef, self._logprob_span,
                                                 version=self.version, local_updates=self.local_updates)
        metrics.update(prepared)
        t1 = time.perf_counter()
        metrics.update(self.wg.update(update_input(batch, self.algorithm.recompute_old_log_probs)))
        self.local_updates += 1
        t2 = time.perf_counter()
        self._save_train_output(batch, metrics)
        mask_tokens = int(batch["attention_mask"].sum())
        self.trained_tokens += mask_tokens
        metrics["timing_s/prepare"] = t1 - t0
        metrics["timing_s/update_actor"] = t2 - t1
        metrics["timing_s/step"] = time.perf_counter() - t0
        metrics["perf/step_tokens_per_s"] = mask_tokens / max(t2 - t0, 1e-9)
        metrics.update(self._verl_perf(mask_tokens, metrics["timing_s/step"], t2 - t1))
        self.timeline.record("trainer/driver", "train", step_start, self.timeline.now(), self.version, tokens=mask_tokens)
        return metrics

    def _verl_perf(self, tokens: int, step_s: float, update_s: float) -> dict[str, float]:
        """verl's timing_s/gen (this step's wait for its groups) and perf/{total_num_tokens, time_per_step,
        throughput (tokens / s / device), mfu/actor (utils/flops.py; accelerators it knows only)}."""
        from verl_async.utils.flops import mfu, promised_flops

        devices = max(1, len(getattr(self.wg, "workers", []) or [1]))
        out = {"timing_s/gen": self._wait_this_step, "perf/total_num_tokens": float(tokens),
               "perf/time_per_step": step_s + self._wait_this_step,
               "perf/throughput": tokens / max((step_s + self._wait_this_step) * devices, 1e-9)}
        info = (getattr(self.wg, "info", None) or [{}])[0]
        if str(self.cfg.actor_rollout_ref.actor.strategy) != "megatron" and "params" in info:  # FSDP: the full count
            value = mfu(int(info["params"]), tokens, update_s, devices, promised_flops(info.get("device_name")),
                        epochs=int(self.cfg.actor_rollout_ref.actor.ppo_epochs))
            if value is not None:
                out["perf/mfu/actor"] = value
        return out

    def _logprob_span(self):
        return self.timeline.span("trainer/driver", "logprob", self.version)

    # ------------------------------------------------------------------ debug dumps
    def _save_rollout_data(self, groups: list[RolloutSample]) -> None:
        pattern = self.cfg.debug.get("save_rollout_data")
        if pattern:
            path = str(pattern).format(rollout_id=self.step)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save([g.to_dict() for g in groups], path)

    def _save_train_output(self, batch: TensorDict, metrics: dict[str, float]) -> None:
        pattern = self.cfg.debug.get("save_train_output")
        if not pattern:
            return
        path = str(pattern).format(rollout_id=self.step, rank=0)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        keys = ["responses", "response_mask", "rollout_log_probs", "old_log_probs", "advantages", "token_versions"]
        tensors = {k: batch[k].clone() for k in keys if k in batch.keys()}
        if "ref_log_prob" in batch.keys():
            tensors["ref_log_prob"] = batch["ref_log_prob"].clone()
        tensors["importance_ratio_old_over_rollout"] = torch.exp(batch["old_log_probs"] - batch["rollout_log_probs"]) * batch["response_mask"]
        torch.save({"step": self.step, "version": self.version, "metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}, "tensors": tensors}, path)


def load_rollout_groups(pattern: str) -> Callable[[int], Optional[list[RolloutSample]]]:
    """debug.load_rollout_data: step k trains on the groups saved as pattern.format(rollout_id=k)."""

    def source(step: int) -> Optional[list[RolloutSample]]:
        path = pattern.format(rollout_id=step)
        if not os.path.exists(path):
            return None
        return [RolloutSample.from_dict(d) for d in torch.load(path, weights_only=False)]

    return source
