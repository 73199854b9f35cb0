"""Weight sync's guards (issue 28): replicas out of rotation, parameters a sync never wrote, the timeout's key."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from tests.fakes import FakeEngine
from verl_async.config import compose, validate
from verl_async.data import builtin, write_rows
from verl_async.rollout.native import NativeEngine
from verl_async.rollout.service import RolloutService
from verl_async.sync import SyncError, sync_timeout_s
from verl_async.sync.collective import RolloutSide as CollectiveRolloutSide
from verl_async.sync.object_store import EngineSide, ObjectStoreSync


class BrokenEngine(FakeEngine):
    """A replica whose every call fails (a wedged device): what leaves the rotation."""

    async def update_weights(self, named_tensors, version):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async def abort(self, request_ids=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.fixture
def service(tmp_path, tiny_model_dir):
    rows = builtin.generate_rows("train", 4, seed=3)
    write_rows(rows, str(tmp_path / "train.parquet"))
    cfg = validate(compose(overrides=[
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={tmp_path / 'train.parquet'}",
        "data.val_files=null", "data.max_prompt_length=64", "data.max_response_length=12",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]))
    svc = RolloutService(cfg, None, model_path=tiny_model_dir, run_dir=str(tmp_path / "run"), run_start=time.time(),
                         engines=[FakeEngine(), BrokenEngine()])
    yield svc
    svc.reward.close()


def test_a_replica_out_of_rotation_is_neither_paused_nor_synced(service):
    async def sync(version: int) -> None:
        await service.pause_for_sync()
        await service.weight_sync("object_store", "load", [("w", torch.ones(2))], version=version)

    with pytest.raises(RuntimeError, match="illegal memory access"):  # in rotation: its failure is the run's
        asyncio.run(sync(1))
    service.rollouter.health.out[1] = "32 failed requests in a row"
    asyncio.run(sync(2))
    good = service.engines[0]
    assert good.version == 2 and torch.equal(good.weights["w"], torch.ones(2))
    assert [id(e) for e in service.sync_engines] == [id(good)]


def test_the_collective_group_reforms_when_a_member_left_the_rotation():
    engines = [FakeEngine(), FakeEngine()]
    owner = SimpleNamespace(sync_engines=list(engines))
    side = CollectiveRolloutSide(owner)
    side.members = list(engines)  # as after a join
    assert not asyncio.run(side.members_changed())
    owner.sync_engines = engines[:1]
    assert asyncio.run(side.members_changed())


# ------------------------------------------------------------------------------------------ coverage
def test_the_native_engine_names_the_parameters_a_sync_did_not_write(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    state = {n: p.detach().clone() + 0.5 for n, p in
             AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters()}
    skipped = "model.norm.weight"

    async def main():
        eng = NativeEngine(tiny_model_dir, max_num_seqs=2, max_model_len=32)
        try:
            half = EngineSide(eng)
            assert await half.unwritten(version=3) == list(state)  # nothing under version 3 yet
            names = list(state)
            # a sync in two loads (object store: one per bucket) that never sends `skipped`
            await half.load([[(n, state[n]) for n in names[:3]]], version=3)
            await half.load([[(n, state[n]) for n in names[3:] if n != skipped]], version=3)
            assert await half.unwritten(version=3) == [skipped]
            await half.load([[(n, state[n]) for n in names]], version=4)
            assert await half.unwritten(version=4) == []
            assert await half.unwritten(version=3) == names  # counted per version
        finally:
            await eng.shutdown()

    asyncio.run(main())


def test_a_sync_that_left_parameters_unwritten_fails_naming_them(monkeypatch):
    asked = []

    def rollout(self, step, what, *args, **kwargs):
        asked.append((step, kwargs))
        return {"replica 1": ["model.norm.weight"]}

    monkeypatch.setattr(ObjectStoreSync, "rollout", rollout)
    driver = ObjectStoreSync(None, None, bucket_bytes=1 << 20)
    with pytest.raises(SyncError, match=r"version 5 left 1 parameter\(s\) of replica 1 unwritten.*model\.norm\.weight"):
        driver.check_coverage(5)
    assert asked == [("unwritten", {"version": 5})]
    monkeypatch.setattr(ObjectStoreSync, "rollout", lambda self, step, what, *a, **k: {})
    driver.check_coverage(6)  # every replica complete: nothing raised


# ------------------------------------------------------------------------------------------ timeout
def test_the_sync_timeout_is_a_key_with_a_default_from_the_run():
    def cfg(**at):
        return SimpleNamespace(async_training=SimpleNamespace(get=lambda k: at.get(k), **at),
                               data=SimpleNamespace(max_response_length=2048))

    assert sync_timeout_s(cfg(partial_rollout=True, sync_timeout_s=None)) == 600.0
    assert sync_timeout_s(cfg(partial_rollout=False, sync_timeout_s=None)) == 600.0 + 2048
    assert sync_timeout_s(cfg(partial_rollout=False, sync_timeout_s=30)) == 30.0


def test_a_slow_weight_sync_fails_the_run_naming_its_timeout_key(ray_session, monkeypatch, tmp_path, tiny_model_dir):
    """An engine whose weight load outlasts async_training.sync_timeout_s: the Trainer's push fails within it, and the
    run's one line (errors.root_cause) says which key to raise."""
    import ray

    from verl_async.errors import root_cause
    from verl_async.sync import object_store, rollout_weight_sync
    from verl_async.trainer.trainer import Trainer

    class SlowLoad:  # a replica's engine (a slow disk, a stuck device): its load takes a minute
        async def update_weights(self, named_tensors, version):
            await asyncio.sleep(60)

    @ray.remote
    class Rollout:  # the rollout side as RolloutService has it: pause, resume, the one forwarding call
        def __init__(self):
            self.sync_engines = [SlowLoad()]

        async def pause_for_sync(self):
            pass

        async def resume_after_sync(self, version):
            pass

        async def weight_sync(self, transport, step, *args, **kwargs):
            return await rollout_weight_sync(self, transport, step, *args, **kwargs)

    cfg = validate(compose(overrides=[
        f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path / 'run'}", "async_training.sync_transport=object_store",
        "async_training.sync_timeout_s=2"]))
    bucket = ray.put([("w", torch.ones(2))])  # what trainer rank 0 streams, without a worker group
    monkeypatch.setattr(object_store, "bucket_refs", lambda worker_group, bucket_bytes, dtype=None: iter([bucket]))
    rollout = Rollout.remote()
    ray.get(rollout.resume_after_sync.remote(0), timeout=120)  # started: the 2 s are the load's alone
    trainer = Trainer(cfg, None, rollout, run_dir=str(tmp_path), run_start=time.time(), pad_token_id=0,
                      worker_group=SimpleNamespace())
    t0 = time.monotonic()
    try:
        with pytest.raises(SyncError) as caught:
            trainer.push_weights(False)
    finally:
        ray.kill(rollout)
    assert time.monotonic() - t0 < 30
    assert root_cause(caught.value) == (
        "SyncError: parameter sync: loading bucket 0 did not finish on ['rollouter'] within 2s (a member is dead or "
        "stuck; raise async_training.sync_timeout_s if it is only slow)")


def test_a_dead_actor_behind_a_sync_is_the_runs_root_cause(ray_session):
    """A replica that dies during a sync: SyncError names the step; the run's one line names the dead actor."""
    import ray

    from verl_async.errors import root_cause

    @ray.remote
    class Dies:
        def pause_for_sync(self):
            import os

            os._exit(1)

    driver = ObjectStoreSync(None, Dies.remote(), bucket_bytes=1 << 20, timeout_s=60)
    with pytest.raises(SyncError, match="rollouter failed in pausing the rollouter") as caught:
        driver.push(1)
    assert root_cause(caught.value).startswith("ActorDiedError: ")
