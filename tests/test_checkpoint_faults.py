"""Checkpoints under faults: a group that lands during the checkpoint, a save that dies half-way."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import pytest
import ray
from omegaconf import OmegaConf

from tests.test_rollouter import make
from verl_async.config.cli import REPO_ROOT
from verl_async import checkpoint as ckpt
from verl_async.trainer.trainer import Trainer
from verl_async.trainer.worker_group import FSDPWorkerGroup


class LoopThread:
    """An event loop in a thread: the 'actor' side of the in-process stand-ins below."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, fn, *args, timeout: float = 10):
        async def run():
            out = fn(*args)
            return await out if asyncio.iscoroutine(out) else out

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Handle:
    """`handle.method.remote(*args)` runs the method on the loop thread (ray.get is patched to pass values)."""

    def __init__(self, obj, loop: LoopThread, after=None) -> None:
        self._obj, self._loop, self._after = obj, loop, after

    def __getattr__(self, name):
        handle = self

        class Method:
            @staticmethod
            def remote(*args):
                out = handle._loop.call(getattr(handle._obj, name), *args)
                if handle._after is not None:
                    handle._after(name)
                return out

        return Method()


class ServiceState:
    """What RolloutService.state_dict contributes here: the Rollouter's pending prompts."""

    def __init__(self, ro) -> None:
        self.ro = ro

    def state_dict(self) -> dict:
        return {"pending": [asdict(t) for t in self.ro.pending_items()]}


class CapturingGroup:
    def __init__(self) -> None:
        self.extra = self.info = None

    def save_checkpoint(self, root, extra, step, info=None):
        self.extra, self.info = extra, info


def test_group_finishing_during_a_checkpoint_is_kept(monkeypatch, tmp_path):
    """A slow scorer finishes a group between the checkpoint's two snapshots: it must be in one of them."""
    loop = LoopThread()
    release = asyncio.Event()

    async def slow_score(item, responses):
        await release.wait()
        return [(0.0, {}) for _ in responses]

    ro, q = make(1, n=2, required=1, trigger=1, threshold=0.0, scorer=slow_score, partial=False)
    run = asyncio.run_coroutine_threadsafe(ro.run(), loop.loop)
    deadline = time.time() + 10
    while not (ro._inflight and ro._running_requests == 0 and ro.counters.generated_tokens > 0):
        assert time.time() < deadline
        time.sleep(0.01)
    loop.call(ro.pause_for_sync)  # generation done; the group is in the scorer

    first = []

    def between(name: str) -> None:  # after the first snapshot: the scorer finishes, the group is put
        if not first:
            first.append(name)
            loop.loop.call_soon_threadsafe(release.set)
            time.sleep(0.3)

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path)},
                                    "actor_rollout_ref": {"rollout": {"n": 2}}})
    trainer.version, trainer.step, trainer.kl_coef = 1, 1, 0.001
    trainer.call_timeout_s = 60.0  # trainer.worker_timeout_s
    trainer.wg = CapturingGroup()
    trainer.queue = Handle(q, loop, between)
    trainer.rollouter = Handle(ServiceState(ro), loop, between)
    try:
        trainer.save_checkpoint()
        extra = trainer.wg.extra
        kept = [g["uid"] for g in extra["queue"]] + [p["uid"] for p in extra["rollouter"]["pending"]]
        assert "e0-i0" in kept, extra
        assert trainer.wg.info == {"step": 1, "version": 1, "rollout_n": 2}  # run_info.json: what a resume must match
        loop.call(ro.resume_after_sync, 1)
        run.result(10)
    finally:
        loop.stop()


class DyingSave:
    """A worker group's save(): writes its shards then meta.json, or dies after the first shard."""

    def __init__(self) -> None:
        self.die = False

    def __call__(self, path: str, extra=None) -> str:
        os.makedirs(path, exist_ok=True)
        tag = extra["tag"]
        with open(os.path.join(path, "shard0"), "w") as f:
            f.write(tag)
        if self.die:
            raise RuntimeError("killed half-way through the save")
        with open(os.path.join(path, "shard1"), "w") as f:
            f.write(tag)
        with open(os.path.join(path, ckpt.COMPLETE_MARKER), "w") as f:
            json.dump({"tag": tag}, f)
        return path


def test_save_that_dies_half_way_leaves_the_complete_checkpoint(tmp_path):
    """finish() may save the step the last sync saved: a crash then must not leave a torn folder."""
    group = FSDPWorkerGroup.__new__(FSDPWorkerGroup)
    group.settings = type("S", (), {"max_ckpt_to_keep": 2})()
    group.save = DyingSave()
    root = str(tmp_path)
    group.save_checkpoint(root, {"tag": "sync"}, step=4)
    group.save.die = True
    with pytest.raises(RuntimeError, match="half-way"):
        group.save_checkpoint(root, {"tag": "final"}, step=4)
    path = ckpt.latest_checkpoint(root)
    assert path == ckpt.checkpoint_dir(root, 4)
    contents = {name: open(os.path.join(path, name)).read() for name in ("shard0", "shard1")}
    assert contents == {"shard0": "sync", "shard1": "sync"}, contents  # all of one save
    group.save.die = False
    group.save_checkpoint(root, {"tag": "final"}, step=4)  # a later save of the step replaces it whole
    assert open(os.path.join(path, "shard0")).read() == "final"
    assert sorted(os.listdir(root)) == ["global_step_4", ckpt.LATEST_FILE]


# --------------------------------------------------------------------------- a kill inside publish()
KILL_BETWEEN_RENAMES = """
import os, signal, sys
from tests.test_checkpoint_faults import DyingSave
from verl_async import checkpoint as ckpt
from verl_async.trainer.worker_group import FSDPWorkerGroup

group = FSDPWorkerGroup.__new__(FSDPWorkerGroup)
group.settings = type("S", (), {"max_ckpt_to_keep": 1})()
group.save = DyingSave()
root = sys.argv[1]
group.save_checkpoint(root, {"tag": "sync"}, step=4)  # the last sync's checkpoint of step 4
real, calls = os.replace, []

def replace(src, dst):  # the final save publishes step 4 again: SIGKILL between its two renames
    calls.append(dst)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)

ckpt.os.replace = replace
group.save_checkpoint(root, {"tag": "final"}, step=4)
"""


def kill_between_the_renames(root) -> None:
    proc = subprocess.run([sys.executable, "-c", KILL_BETWEEN_RENAMES, str(root)], cwd=REPO_ROOT,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(os.listdir(root)) == ["global_step_4.old", "global_step_4.tmp", ckpt.LATEST_FILE]  # torn


def test_kill_between_the_renames_of_a_republish_keeps_the_step(tmp_path):
    """publish() of a step already on disk renames it away, then the new one in: a SIGKILL in between leaves
    only `.old` (the previous save) and `.tmp` (the new, complete one). The newer complete one is the step."""
    root = str(tmp_path)
    kill_between_the_renames(root)
    found = ckpt.latest_checkpoint(root)  # read-only: what a preflight sees
    assert found is not None and open(os.path.join(found, "shard1")).read() == "final"
    assert ckpt.recover_interrupted_publish(root) == [f"{ckpt.step_folder(root, 4)}.tmp -> {ckpt.step_folder(root, 4)}"]
    assert sorted(os.listdir(root)) == ["global_step_4", ckpt.LATEST_FILE]
    assert ckpt.latest_checkpoint(root) == ckpt.checkpoint_dir(root, 4)
    assert open(os.path.join(ckpt.checkpoint_dir(root, 4), "shard0")).read() == "final"


def test_recovery_falls_back_to_the_previous_save_and_drops_torn_staging(tmp_path):
    """Without a complete `.tmp`, the `.old` folder (the step's previous complete save) goes back in place;
    a staging folder without its marker (a save that died) is removed; nothing complete is touched."""
    root = str(tmp_path)
    for step, tag in ((2, "two"), (4, "old")):
        os.makedirs(ckpt.checkpoint_dir(root, step))
        DyingSave()(ckpt.checkpoint_dir(root, step), {"tag": tag})
    os.replace(ckpt.step_folder(root, 4), ckpt.step_folder(root, 4) + ".old")
    os.makedirs(ckpt.step_folder(root, 4) + ".tmp/actor")  # died before its meta.json
    os.makedirs(ckpt.step_folder(root, 6) + ".tmp/actor")  # a later step's save that died
    assert ckpt.latest_checkpoint(root) == ckpt.step_folder(root, 4) + ".old/actor"
    ckpt.recover_interrupted_publish(root)
    assert sorted(os.listdir(root)) == ["global_step_2", "global_step_4"]
    assert open(os.path.join(ckpt.checkpoint_dir(root, 4), "shard0")).read() == "old"


class FakeGroup:
    """A worker group's load(): the `extra` a checkpoint was saved with (its tag says which save it was)."""

    def load(self, path: str) -> dict:
        with open(os.path.join(path, ckpt.COMPLETE_MARKER)) as f:
            tag = json.load(f)["tag"]
        return {"version": 4, "step": 4, "queue": [], "rollouter": {}, "tag": tag}


class Recorder:
    def __init__(self) -> None:
        self.calls = []

    def __getattr__(self, name):
        calls = self.calls

        class Method:
            @staticmethod
            def remote(*args):
                calls.append(name)
                return 0

        return Method()


def test_resume_after_a_kill_between_the_renames_keeps_the_trained_record(monkeypatch, tmp_path):
    """The issue's outcome: auto-resume restarted from step 0 and truncated trained_uids.jsonl."""
    root = tmp_path / "run"
    root.mkdir()
    kill_between_the_renames(str(root))
    log = root / "trained_uids.jsonl"
    log.write_text("".join(json.dumps({"step": s, "version": s, "uids": [f"0:{s}"]}) + "\n" for s in range(5)))
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = OmegaConf.create({"trainer": {"default_local_dir": str(root), "resume_mode": "auto"},
                                    "algorithm": {"kl_ctrl": {"type": "fixed"}}})
    trainer.wg, trainer.queue, trainer.rollouter = FakeGroup(), Recorder(), Recorder()
    trainer._trained_log = str(log)
    trainer.version = trainer.step = 0
    trainer.kl_coef = 0.001
    trainer.call_timeout_s = 60.0  # trainer.worker_timeout_s
    from verl_async.utils.tracking import Tracker

    trainer.tracker = Tracker([], str(root / "tensorboard"))  # no logger: nothing to truncate
    assert trainer.restore() == 4 and trainer.step == 4
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2, 3]
    assert sorted(os.listdir(root)) == ["global_step_4", ckpt.LATEST_FILE, "trained_uids.jsonl"]
