"""The whole run on one screen: Ray, queue, Rollouter, Trainer, sync, wait.

`run(cfg)` is what `python -m recipe.fully_async_main` calls after validation. Every
actor is a plain class wrapped by Ray here (the only place that knows about actor
options); if either side dies the other is stopped and the root cause is raised.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import ray
from omegaconf import DictConfig, OmegaConf

from verl_async.config.ray_address import check_ray_address, ray_address, started_cluster_here
from verl_async.config.run_paths import CACHE_KEY, absolute_paths, cache_root, shared_folders
from verl_async.models.builtin import resolve_model_path
from verl_async.models.loading import run_tokenizer
from verl_async.queue import MessageQueue
from verl_async.config.derived import (FINISH_TIMEOUT_RULE, colocated_device_ids, cpu_threads, max_required_samples,
                                      replica_start_timeout_s, required_samples)
from verl_async.config.resume import step_of
from verl_async.errors import PipelineError, root_cause
from verl_async.outcome import RunCounts, shortfall, zero_steps_error
from verl_async.healing.report import heal_summary
from verl_async.healing.trainer import TrainerSupervisor
from verl_async.placement import NodePlan, PlacementError, check_plans, pin, where
from verl_async.rollout.service import RolloutService, rollout_plan
from verl_async.sync import sync_timeout_s
from verl_async.trainer.megatron.worker_group import MegatronWorkerGroup
from verl_async.trainer.trainer import Trainer, format_validation, load_rollout_groups
from verl_async.trainer.worker_group import FSDPWorkerGroup, trainer_node_plan
from verl_async.utils.shared_dirs import SharedDir, mark, unmark, verify_here
from verl_async.utils.threads import local_cores, set_torch_threads, wait_policy_env
from verl_async.utils.startup import Phase, StartupClock, format_startup, record_actor, record_phases, startup_breakdown
from verl_async.utils.timeline import Timeline, busy_fraction, read_spans, render_timeline_html

logger = logging.getLogger("verl_async")

LOGGER_ENV = ("TENSORBOARD_DIR", "VERL_FILE_LOGGER_PATH")  # where verl's loggers write (utils/tracking_backends.py)
LOCAL_NODE_RESOURCE = 1.0  # what a local Ray carries of each named *.node_resource (as `ray start --resources`)

# actor_rollout_ref.actor.strategy -> worker group (verl's FSDP1 "fsdp" runs as FSDP2). Megatron's module
# imports no megatron-core; its group asks for it when built (verl_async.optional).
WORKER_GROUPS = {"fsdp": FSDPWorkerGroup, "fsdp2": FSDPWorkerGroup, "megatron": MegatronWorkerGroup}


def build_worker_group(cfg: Any, shared_dirs: Sequence[SharedDir] = ()) -> Any:
    strategy = str(cfg.actor_rollout_ref.actor.strategy)
    if strategy not in WORKER_GROUPS:
        raise ValueError(f"actor_rollout_ref.actor.strategy: unknown {strategy!r}; available: {sorted(WORKER_GROUPS)}")
    group = WORKER_GROUPS[strategy](cfg, shared_dirs=shared_dirs)
    group.init()
    return group


class TrainerHost(Trainer):
    """The Trainer actor: builds its worker group (unless rollout-only) in its own process."""

    def __init__(self, cfg: Any, queue: Any, rollouter: Any, *, run_dir: str, run_start: float,
                 pad_token_id: Optional[int], shared_dirs: Sequence[SharedDir] = ()) -> None:
        self.startup = StartupClock()
        verify_here(shared_dirs, "the trainer")
        set_torch_threads(1)  # collates and prepares batches; the ranks compute (utils/threads.py)
        debug = cfg.debug
        load = debug.get("load_rollout_data")
        wg = None if debug.get("rollout_only") else build_worker_group(cfg, shared_dirs)
        if wg is not None:
            self.startup.add(wg.startup_phases)
        self._console: collections.deque[str] = collections.deque()  # the console logger's lines, for the driver
        with self.startup.phase("trainer_setup"):  # loggers (TensorBoard), the weight-sync transport
            super().__init__(
                cfg, queue, rollouter, run_dir=run_dir, run_start=run_start, pad_token_id=pad_token_id,
                worker_group=wg, group_source=load_rollout_groups(str(load)) if load else None,
                console_sink=self._console.append,
            )
        if wg is not None:
            for rank, (created, report) in enumerate(wg.rank_reports):
                record_actor(self.timeline, f"rank{rank}", created, report)

    def set_pad_token_id(self, pad_token_id: int) -> None:
        """The tokenizer's pad id, from the driver once its tokenizer loaded (the first Trainer starts before)."""
        self.pad_token_id = int(pad_token_id)

    def progress(self) -> dict[str, Any]:
        """The Trainer's progress and the console lines logged since the last call (the driver prints them above
        its progress bar)."""
        return {**super().progress(), "console": self.take_console()}

    def take_console(self) -> list[str]:
        lines = []
        while self._console:
            lines.append(self._console.popleft())
        return lines

    def startup_report(self) -> dict[str, Any]:
        """This actor's start-up phases (utils/startup.py); its ranks' lanes are in the timeline already."""
        return self.startup.report()

    def placement(self) -> str:
        """Where the worker group's ranks run ("" without one: rollout-only)."""
        return "" if self.wg is None else where("ranks", self.wg.placement())

    def shutdown(self) -> None:
        self.close()
        if self.wg is not None:
            self.wg.shutdown()


def ray_init(cfg: Any) -> bool:
    """Join the configured cluster, or start a local Ray (token authentication on: Ray's default).

    Joining is checked first (config/ray_address.py: a wrong address, a missing token, an
    unreachable node fail in seconds, in one line). Workers get what the driver decided: its
    code (PYTHONPATH) and its cache folder (VERL_ASYNC_CACHE). A local Ray carries the
    `*.node_resource` the config names, so a config pinned for a cluster also runs on one machine.
    Returns True when this process started Ray (and should shut it down).

    Start-up: a local Ray whose runtime_env is environment variables only gets them by inheritance (its
    processes start from this one's environment) instead of as a job runtime_env (`local_system_config`).
    """
    if ray.is_initialized():
        return False
    address, key = ray_address(cfg)
    runtime_env = ray_runtime_env(cfg)
    if address:
        check_ray_address(cfg)
        try:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as exc:  # the probe passed, ray.init did not
            raise PipelineError(f"{key}={address}: ray.init failed: {' '.join(str(exc).split())}") from None
        return True
    num_cpus = cfg.ray_init.get("num_cpus")
    pinned = {name: LOCAL_NODE_RESOURCE for name in node_resources(cfg)}
    quiet_default_auth_notice()
    left = started_cluster_here()
    if left:  # ray.init() would join it and then refuse ray_init.num_cpus; another run's Ray is not this run's
        print(f"ray          a local Ray of its own; the cluster `ray start` left on this machine ({left}) is joined "
              f"with ray_init.address=auto", flush=True)
    inherited = runtime_env["env_vars"] if set(runtime_env) == {"env_vars"} else None
    with _environment(inherited or {}):  # the processes ray.init starts take them with them
        ray.init(
            address="local",
            num_cpus=None if num_cpus is None else int(num_cpus),
            resources=pinned or None,
            include_dashboard=False,
            runtime_env=runtime_env if inherited is None else None,
            log_to_driver=True,
            logging_level=logging.WARNING,
            _system_config=local_system_config(cfg, inherited=inherited is not None),
        )
    return True


PRESTART_MAX_WORKERS = 8  # ray_init.prestart_workers=null: Ray's prestarted workers up to this many CPUs


def prestarts_workers(cfg: Any) -> bool:
    """Whether a local Ray prestarts its idle workers: `ray_init.prestart_workers`, or (null) when it would start
    at most PRESTART_MAX_WORKERS of them (one per CPU of the local Ray: `ray_init.num_cpus`, else this process's
    cores)."""
    asked = cfg.ray_init.get("prestart_workers")
    if asked is not None:
        return bool(asked)
    cpus = cfg.ray_init.get("num_cpus")
    return min(int(cpus) if cpus else local_cores(), local_cores()) <= PRESTART_MAX_WORKERS


def local_system_config(cfg: Any, *, inherited: bool) -> Optional[dict]:
    """Ray's system config for a local Ray: its prestarted workers and what they import (start-up).

    Ray's raylet starts one idle worker per CPU for the first driver, and `ray.init` returns only once they have
    registered (up to one per core). A run creates a handful of actors; the idle workers spare each one its own
    worker's start (0.5-1 s), but on a 32-core host waiting for 32 of them was 9-11 s of `driver/ray_init`
    (bench/RESULTS.md, start-up). So `prestarts_workers`: on small hosts only, unless `ray_init.prestart_workers`
    says. They serve the actors only with the environment by inheritance (Ray gives a job with a runtime_env
    fresh workers only), and import `ray_init.preload_modules` before one comes. Not transformers: nothing may
    touch CUDA before Ray has set a GPU actor's CUDA_VISIBLE_DEVICES, and `import torch` does not."""
    if not (inherited and prestarts_workers(cfg)):
        return {"prestart_worker_first_driver": False}
    modules = [str(m) for m in (cfg.ray_init.get("preload_modules") or [])]
    return {"preload_python_modules": modules} if modules else None


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """`env` in os.environ for the block, then as it was."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def ray_runtime_env(cfg: Any) -> dict:
    """What every Ray worker gets: verl_async's env_vars, merged with `ray_init.runtime_env` (verl's
    `ray_kwargs.ray_init.runtime_env`) as verl merges it onto its defaults: the run's keys win, key by key.

    One exception keeps the workers able to import verl_async: a PYTHONPATH of the run's is appended to ours,
    not put in its place. Null values (verl's `py_executable: null`) mean Ray's default and are left out."""
    # Workers import verl_async from where this process did (a checkout run without `pip install -e` too).
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    env = {
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"),
        # transformers' "Loading weights" bars, one per model load and process, come through Ray's log as
        # garbled lines; the run's own progress is the driver's bar
        "HF_HUB_DISABLE_PROGRESS_BARS": os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        "PYTHONPATH": python_path,
        CACHE_KEY: cache_root(),
        **wait_policy_env(),  # OpenMP threads sleep, not spin, while waiting (utils/threads.py)
    }
    for name in LOGGER_ENV:  # verl's logger locations, as the driver means them (a relative path: its cwd)
        if os.environ.get(name):
            env[name] = os.path.abspath(os.path.expanduser(os.environ[name]))
    if cfg.actor_rollout_ref.rollout.get("true_on_policy"):  # cuBLAS settings read at start / the CPU kind
        from verl_async.invariant.shapes import worker_env

        env.update(worker_env(str(cfg.trainer.device)))
    ray_init_cfg = cfg.get("ray_init") or {}
    extra = ray_init_cfg.get("runtime_env") or {}
    if OmegaConf.is_config(extra):
        extra = OmegaConf.to_container(extra, resolve=True)
    extra = {k: v for k, v in dict(extra).items() if v is not None}
    theirs = {str(k): str(v) for k, v in dict(extra.pop("env_vars", None) or {}).items()}
    if "PYTHONPATH" in theirs:
        theirs["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], theirs["PYTHONPATH"]))
    return {**extra, "env_vars": {**env, **theirs}}


class _DropDefaultAuthNotice(logging.Filter):
    """Ray's "Token authentication is enabled for this Ray cluster" notice: the default this project keeps
    (docs/architecture.md, Safety defaults), nothing for a user to do. Ray's other auth warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("Token authentication is enabled")


def quiet_default_auth_notice() -> None:
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropDefaultAuthNotice) for f in auth_log.filters):
        auth_log.addFilter(_DropDefaultAuthNotice())


def trainer_heals(cfg: Any) -> bool:
    """Whether a dead trainer side restarts from its checkpoint (healing/trainer.py): trainer.max_restarts > 0, a
    trainer to restart, and checkpoints to restart from (trainer.save_freq > 0: the queue keeps the groups taken
    since the last one, which without checkpoints would be every group of the run)."""
    return (int(cfg.trainer.get("max_restarts", 0) or 0) > 0 and int(cfg.trainer.save_freq or -1) > 0
            and not cfg.debug.get("rollout_only"))


def node_resources(cfg: Any) -> list[str]:
    """The Ray custom resources `trainer.node_resource` / `rollout.node_resource` name."""
    return sorted({str(r) for r in (cfg.trainer.get("node_resource"), cfg.rollout.get("node_resource")) if r})


def _actor_cls(cls: type, **options: Any):
    return ray.remote(cls).options(**options)


def _get(what: str, ref: Any, timeout: float, key: str = "trainer.worker_timeout_s") -> Any:
    """ray.get of one setup/teardown call; its failure becomes "run failed: <what> failed: <root cause>",
    its timeout "run failed: <what> did not finish within <timeout> s; raise <key>"."""
    try:
        return ray.get(ref, timeout=timeout)
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
        raise PipelineError(f"{what} failed: {root_cause(exc)}") from exc
    except ray.exceptions.GetTimeoutError as exc:
        raise PipelineError(f"{what} did not finish within {timeout:.0f} s; raise {key}") from exc


def wait_both(refs: dict[str, Any], trainer: Any, stoppers: dict[str, Any], show_progress: bool = True,
              total_steps: Optional[int] = None, heal: Optional[Callable[[BaseException], Any]] = None) -> dict[str, Any]:
    """Wait for rollouter and trainer; the first failure stops the other and is raised.

    `heal(exc)`: a trainer failure that heals (healing/trainer.py) gives a new Trainer actor, whose run is
    waited for instead; None: it does not heal."""
    from tqdm import tqdm

    pending = dict(refs)
    results: dict[str, Any] = {}
    bar = tqdm(total=total_steps, desc="training", unit="step", dynamic_ncols=True, disable=not show_progress)
    last_step = 0
    try:
        while pending:
            ready, _ = ray.wait(list(pending.values()), timeout=1.0)
            for ref in ready:
                name = next(k for k, v in pending.items() if v == ref)
                del pending[name]
                try:
                    results[name] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - re-raised with the root cause below
                    healed = _heal(heal, exc) if name == "trainer" else None
                    if healed is not None:
                        trainer = stoppers["trainer"] = healed
                        pending["trainer"] = healed.run.remote()
                        continue
                    for other, handle in stoppers.items():
                        if other != name and handle is not None:
                            try:
                                handle.stop.remote()
                            except Exception:  # noqa: BLE001 - it may be dead too
                                pass
                    raise PipelineError(f"the {name} failed: {root_cause(exc)}") from exc
            try:
                prog = ray.get(trainer.progress.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead trainer shows up in ray.wait next round
                continue
            for line in prog.pop("console", []):
                bar.write(line, file=sys.stdout)  # above the bar, never glued onto its line
            step = int(prog.get("step", 0))
            bar.update(step - last_step)
            last_step = step
            bar.set_postfix(
                v=int(prog.get("version", 0)),
                reward=f"{prog.get('critic/score/mean', 0.0):.3f}",
                stale=f"{prog.get('fully_async/staleness/mean', 0.0):.2f}",
                tok_s=f"{prog.get('perf/trained_tokens_per_s', 0.0):.0f}",
            )
    finally:
        bar.close()
    return results


def _heal(heal: Optional[Callable[[BaseException], Any]], exc: BaseException) -> Any:
    """The healed trainer, or None; a restart that itself fails is the run's error, naming both."""
    if heal is None:
        return None
    try:
        return heal(exc)
    except Exception as again:  # noqa: BLE001
        raise PipelineError(f"the trainer failed: {root_cause(exc)}; restarting it failed: {root_cause(again)}") \
            from again


def run(cfg: DictConfig, before: Sequence[Phase] = ()) -> dict[str, Any]:
    """The run; `before`: the entry point's start-up phases before this call (utils/startup.py)."""
    run_start = time.time()
    clock = StartupClock()
    clock.add(before)
    debug = cfg.debug
    with clock.phase("model_path"):  # a builtin:// model is built (or found in the cache) here
        model_path = resolve_model_path(str(cfg.actor_rollout_ref.model.path))
    # every path an actor sees, decided here: absolute, one run folder (config/run_paths.py)
    cfg = absolute_paths(OmegaConf.merge(cfg, {"actor_rollout_ref": {"model": {"path": model_path}}}))
    model_path = str(cfg.actor_rollout_ref.model.path)
    if cfg.trainer.device == "cpu" and cfg.trainer.get("cpu_threads_per_worker") is None:  # the ranks' share of the cores
        OmegaConf.update(cfg, "trainer.cpu_threads_per_worker", cpu_threads(cfg), merge=False)
    run_dir = str(cfg.trainer.default_local_dir)
    os.makedirs(run_dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(run_dir, "config.yaml"))
    shared = mark(shared_folders(cfg))  # each actor checks that its node sees them (utils/shared_dirs.py)
    # the driver's tokenizer (its pad id goes to the trainer) loads while Ray starts (start-up)
    loading = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    tokenizer = loading.submit(run_tokenizer, cfg.actor_rollout_ref.model, model_path)
    loading.shutdown(wait=False)
    try:
        with clock.phase("ray_init"):
            started_ray = ray_init(cfg)
        try:
            return _run(cfg, model_path, run_dir, run_start, debug, shared, clock=clock, tokenizer=tokenizer)
        finally:
            if started_ray:
                ray.shutdown()
    finally:
        unmark(shared)


def placement_plans(cfg: Any, train_only: bool) -> list[NodePlan]:
    """The trainer's and the rollout's nodes (verl_async/placement.py) as this run will ask for them."""
    plans = []
    if not cfg.debug.get("rollout_only"):
        plans.append(trainer_node_plan(str(cfg.trainer.device), int(cfg.trainer.nnodes), int(cfg.trainer.n_gpus_per_node),
                                       cfg.trainer.get("node_resource") or None))
    if not train_only and not colocated_device_ids(cfg):
        plans.append(rollout_plan(cfg))
    return plans


def _run(cfg: Any, model_path: str, run_dir: str, run_start: float, debug: Any,
         shared: Sequence[SharedDir] = (), clock: Optional[StartupClock] = None,
         tokenizer: Optional[concurrent.futures.Future] = None) -> dict[str, Any]:
    clock = clock or StartupClock()
    timeline_path = os.path.join(run_dir, "timeline.jsonl")
    timeline = Timeline(timeline_path, run_start)
    timeline_at = os.path.getsize(timeline_path) if os.path.exists(timeline_path) else 0  # this run's spans follow
    train_only = bool(debug.get("train_only")) or bool(debug.get("load_rollout_data"))
    timeout = float(cfg.trainer.worker_timeout_s)
    capacity = int(cfg.async_training.get("queue_capacity") or max_required_samples(cfg))
    actors: list[Any] = []
    try:
        with clock.phase("placement"):
            check_plans(placement_plans(cfg, train_only))  # a plan no node can hold: one line now, not a timeout later
    except PlacementError as exc:
        raise PipelineError(str(exc)) from None
    created: dict[str, float] = {}  # actor -> when the driver asked for it (its lane's `worker` phase starts there)
    try:
        heals = trainer_heals(cfg)  # healing/trainer.py: the queue keeps the groups taken since the last checkpoint
        queue = _actor_cls(MessageQueue, num_cpus=0.05, max_concurrency=1000).remote(
            capacity, int(cfg.actor_rollout_ref.rollout.n), keep_taken=heals)
        actors.append(queue)
        rollouter = None
        actors_asked = time.time()
        if not train_only:
            created["rollouter"] = time.time()
            rollouter = _actor_cls(RolloutService, num_cpus=0.2, max_concurrency=1000,
                                   **pin(cfg.rollout.get("node_resource"))).remote(
                cfg, queue, model_path=model_path, run_dir=run_dir, run_start=run_start, shared_dirs=shared
            )
            actors.append(rollouter)
        pad: dict[str, int] = {}  # the tokenizer's pad id: a Trainer started after it is known gets it at once

        def start_trainer(dirs: Sequence[SharedDir] = ()) -> Any:
            return _actor_cls(TrainerHost, num_cpus=0.2, max_concurrency=4,
                              **pin(cfg.trainer.get("node_resource"))).remote(
                cfg, queue, rollouter, run_dir=run_dir, run_start=run_start, pad_token_id=pad.get("id"),
                shared_dirs=dirs,
            )

        created["trainer"] = time.time()
        trainer = start_trainer(shared)
        actors.append(trainer)
        # the first trainer starts before the driver's tokenizer is in (start-up): its pad id follows as a call
        with clock.phase("tokenizer"):  # what is left of its load (it began beside Ray's start)
            tokenizer = (tokenizer.result() if tokenizer is not None
                         else run_tokenizer(cfg.actor_rollout_ref.model, model_path))
        pad["id"] = int(tokenizer.pad_token_id)
        pad_sent = trainer.set_pad_token_id.remote(pad["id"])
        # each actor's start (its replicas or ranks, their nodes' folders) fails here, named, before the resume
        # (the engines' own deadline, rollout.start_timeout_s, fires first)
        prompts = None if rollouter is None else int(
            _get("starting the Rollouter and its engine replicas", rollouter.total_prompts.remote(),
                 timeout + replica_start_timeout_s(cfg)))
        _get("starting the trainer and its worker group", trainer.progress.remote(), timeout)
        _get("the trainer's pad token id", pad_sent, timeout)
        clock.phases.append(("actors", actors_asked, time.time()))
        unmark(shared)  # every actor of the run has checked its node: the markers are done
        placed = _placement(trainer, rollouter, timeout)
        if placed:
            print(f"placement: {placed}", flush=True)
        for name, handle in (("rollouter", rollouter), ("trainer", trainer)):
            if handle is not None:
                record_actor(timeline, name, created[name],
                             _get("the start-up report", handle.startup_report.remote(), timeout))
        with clock.phase("resume"):
            version = _get("the resume", trainer.restore.remote(), timeout)
        total_steps = None if prompts is None else max(1, -(-prompts // required_samples(cfg)))
        cap = int(cfg.trainer.get("total_training_steps") or 0)
        if cap:  # the trainer stops there (a run with algorithm.filter_groups needs more prompts than steps)
            total_steps = min(total_steps, cap) if total_steps else cap
        resumed = _get("the resume", trainer.resume_point.remote(), timeout)
        print(f"resuming from {resumed['path']}{step_of(resumed['step'], total_steps)}" if resumed["path"]
              else "starting fresh", flush=True)
        with clock.phase("first_sync"):  # version `version` on every replica
            _get("the first weight sync", trainer.push_weights.remote(False), timeout)
        timeouts = _get("the timeouts query", trainer.timeouts.remote(), timeout)
        before: dict[str, Any] = {}
        if rollouter is not None and bool(cfg.trainer.val_before_train) and bool(cfg.trainer.get("val_async", True)):
            # beside the first training rollouts: its line comes with the trainer's console when it ends
            _get("starting the validation before training", trainer.start_validation_before_training.remote(),
                 timeout)
        elif rollouter is not None and bool(cfg.trainer.val_before_train):
            with clock.phase("val_before_train"):
                before, failure = _get("the validation before training", trainer.validate_before_training.remote(),
                                       timeouts["validation_s"] + 60, key="trainer.val_timeout_s")
            _print_console(trainer, timeout)
            if failure:
                print(f"warning: the validation before training (version {version}) failed, training goes on: "
                      f"{failure}", flush=True)
            elif before:
                print(f"validation before training (version {version}): {format_validation(before)}", flush=True)
        record_phases(timeline, "driver", clock.phases)
        clock.phases.clear()  # recorded: a failure from here on records nothing twice
        supervisor = TrainerSupervisor(start_trainer, trainer, queue, rollouter,
                                       max_restarts=int(cfg.trainer.max_restarts) if heals else 0, timeout_s=timeout,
                                       sync_timeout_s=sync_timeout_s(cfg), start_step=int(resumed["step"]),
                                       on_new=actors.append)
        refs = {"trainer": trainer.run.remote()}
        if rollouter is not None:
            refs["rollouter"] = rollouter.run.remote()
        results = wait_both(refs, trainer, {"trainer": trainer, "rollouter": rollouter}, total_steps=total_steps,
                            heal=supervisor.heal if heals else None)
        trainer = supervisor.trainer
        after = _get("the final sync, checkpoint and validation", trainer.finish.remote(), timeouts["finish_s"],
                     key=f"trainer.finish_timeout_s ({FINISH_TIMEOUT_RULE})")
        _print_console(trainer, timeout)
        if after:
            print(f"validation after training (version {results['trainer']['version']}): {format_validation(after)}",
                  flush=True)
        final = _get("the trainer summary", trainer.summary.remote(), timeout)
        results["trainer"]["validation_failures"] = final["validation_failures"]  # finish's too
        before = before or final.get("val_before", {})  # beside training (val_async): it ended after the start
        results["trainer_restarts"] = supervisor.summary()
        return _summarise(run_dir, results, before, after, time.time() - run_start, planned=total_steps,
                          per_step=required_samples(cfg), load_pattern=debug.get("load_rollout_data"),
                          timeline_at=timeline_at)
    finally:
        record_phases(timeline, "driver", clock.phases)  # a start-up that failed: how far it came
        _teardown(actors, timeout=60)


def _print_console(trainer: Any, timeout: float) -> None:
    """The Trainer's console lines not printed yet (logged after the last progress poll)."""
    for line in _get("the trainer's console lines", trainer.take_console.remote(), timeout):
        print(line, flush=True)


def _placement(trainer: Any, rollouter: Any, timeout: float) -> str:
    """"trainer ranks 0-1 on node A (id ..); rollout replicas 0-3 on node B (id ..)" ("" when Ray placed them)."""
    parts = [("trainer", _get("the placement query", trainer.placement.remote(), timeout))]
    if rollouter is not None:
        parts.append(("rollout", _get("the placement query", rollouter.placement.remote(), timeout)))
    return "; ".join(f"{who} {on}" for who, on in parts if on)


def _teardown(actors: list[Any], timeout: float) -> None:
    """Stop the worker group and engine replicas, then the actors (a shared Ray cluster keeps nothing)."""
    for actor in reversed(actors):
        try:
            ray.get(actor.shutdown.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001 - dead or without shutdown(): killed below anyway
            pass
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001
            pass


def _summarise(run_dir: str, results: dict, before: dict, after: dict, wall: float, *,
               planned: Optional[int] = None, per_step: int = 1, load_pattern: Optional[str] = None,
               timeline_at: int = 0) -> dict[str, Any]:
    """Print the run's end (warnings, then one last line) and return its summary; a run that trained nothing
    raises PipelineError saying why and what to change (verl_async/outcome.py)."""
    timeline_path = os.path.join(run_dir, "timeline.jsonl")
    summary: dict[str, Any] = {"wall_s": wall, "run_dir": run_dir, "val_before": before, "val_after": after}
    summary.update({f"trainer/{k}": v for k, v in results.get("trainer", {}).items()
                    if k not in ("validation", "val_before")})
    rollout = results.get("rollouter", {})
    for key in ("failed_prompts", "retried_prompts", "lost_requests", "dropped_groups_engine_error", "replicas_out",
                "reward_errors", "filtered_groups", "engine_profile"):
        if key in rollout:
            summary[f"rollout/{key}"] = rollout[key]
    if os.path.exists(timeline_path):
        spans = read_spans(timeline_path)
        html = render_timeline_html(spans, os.path.join(run_dir, "timeline.html"))
        summary["timeline"] = html
        summary["rollout_busy_fraction"] = busy_fraction(spans, "rollout/replica", ("generate",), wall)
        summary["trainer_busy_fraction"] = busy_fraction(spans, "trainer/driver", ("train", "logprob"), wall)
        summary.update(startup_breakdown(read_spans(timeline_path, offset=timeline_at)))  # this run's spans only
    for index, why in rollout.get("replicas_out", {}).items():
        print(f"warning: engine replica {index} was taken out of rotation: {why}", flush=True)
    summary.update(heal_summary(rollout.get("replica_heals", []), results.get("trainer_restarts", [])))
    resume = rollout.get("resume")
    if resume:  # rollout/partials.py: what the checkpoint held in flight was continued, not generated again
        summary.update({f"resume/{k}": v for k, v in resume.items()})
        print(f"resume: {resume['continued_responses']} response(s) in flight at the checkpoint continued "
              f"({resume['continued_tokens']} of its {resume['saved_tokens']} tokens), "
              f"{resume['regenerated_tokens']} token(s) regenerated", flush=True)
    failures = results.get("trainer", {}).get("validation_failures", [])
    if failures:
        print(f"warning: {len(failures)} validation(s) failed and were skipped, training went on (versions "
              f"{', '.join(str(f['version']) for f in failures)}; first error: {failures[0]['error']})", flush=True)
    if rollout.get("failed_prompts"):
        print(f"warning: {rollout['failed_prompts']} prompt(s) failed on every retry and were not trained "
              f"(list: {os.path.join(run_dir, 'rollout', 'failed_prompts.jsonl')})", flush=True)
    if "filtered_groups" in rollout:
        print(f"algorithm.filter_groups dropped {rollout['filtered_groups']} group(s) whose responses all scored the "
              f"same (list: {os.path.join(run_dir, 'rollout', 'filtered_groups.jsonl')})", flush=True)
    if rollout.get("reward_errors"):
        print(f"warning: the reward function failed on {rollout['reward_errors']} of {rollout.get('reward_scored', 0)} "
              f"scored responses (scored 0; the first failures are in the log; reward_model.max_error_rate)", flush=True)
    steps, start = summary.get("trainer/steps", 0), summary.get("trainer/start_step", 0)
    counts = RunCounts(trained=steps - start, step=steps, planned=planned, per_step=per_step,
                       queued=rollout.get("finished_groups") if rollout else None,
                       filtered=int(rollout.get("filtered_groups", 0)), failed_prompts=int(rollout.get("failed_prompts", 0)),
                       dropped_stale=int(summary.get("trainer/dropped_stale_groups", 0) or 0),
                       load_pattern=None if load_pattern is None else str(load_pattern))
    failed = zero_steps_error(counts)
    if failed:
        raise PipelineError(f"{failed} (outputs in {run_dir})")
    resumed = f" (resumed at step {start}, now at step {steps})" if start else ""
    short = shortfall(counts)
    for line in format_startup(summary):  # where the time before the first token went (utils/startup.py)
        print(line, flush=True)
    print(
        f"done in {wall:.1f}s: {steps - start} steps trained{resumed}, version {summary.get('trainer/version', 0)}, "
        f"outputs in {run_dir} (tensorboard/, timeline.html, rollout/lengths.jsonl)" + (f"; {short}" if short else ""),
        flush=True,
    )
    return summary
