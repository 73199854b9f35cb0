"""Collective weight sync over gloo (the CPU path of nccl/hccl): plans, checksums, threads, real Ray actors."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from verl_async.rollout.replica import SyncTarget
from verl_async.sync import SyncError, build_sync
from verl_async.sync.buckets import (
    ALIGN_BYTES,
    compare_checksums,
    plan_buckets,
    plan_bytes,
    plan_from_wire,
    plan_to_wire,
    tensor_checksum,
)
from verl_async.sync.object_store import full_weights
from verl_async.sync.collective import (
    GlooCollectiveSync,
    LocalEngineSide,
    RolloutSide,
    WeightSyncGroup,
    master_store,
    rank_offsets,
    receive_buckets,
    send_buckets,
)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(37, 16, generator=g),
        "layer.0.w": torch.randn(16, 16, generator=g).bfloat16(),
        "layer.0.b": torch.randn(3, generator=g),
        "layer.1.w": torch.randn(16, 24, generator=g),
        "big": torch.randn(64, 64, generator=g),  # 16 KiB: larger than the bucket, travels alone
        "norm": torch.randn(16, generator=g).half(),
    }


def _meta(tensors):
    return [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


# ------------------------------------------------------------------------------------------ plan
def test_plan_respects_bucket_size_alignment_and_order():
    tensors = _tensors()
    limit = 4096
    plan = plan_buckets(_meta(tensors), limit)
    names = [m.name for b in plan for m in b.tensors]
    assert names == list(tensors)  # order kept: the sender gathers in this order
    assert len(plan) > 2
    for bucket in plan:
        assert bucket.nbytes <= limit or len(bucket.tensors) == 1
        for m in bucket.tensors:
            assert m.offset % ALIGN_BYTES == 0
            assert m.offset + m.nbytes <= bucket.nbytes
        spans = sorted((m.offset, m.offset + m.nbytes) for m in bucket.tensors)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    assert [b.nbytes for b in plan if len(b.tensors) == 1 and b.tensors[0].name == "big"] == [64 * 64 * 4]
    assert plan_bytes(plan) == sum(t.numel() * t.element_size() for t in tensors.values())
    assert plan_from_wire(plan_to_wire(plan)) == plan
    with pytest.raises(ValueError, match="bucket size must be positive"):
        plan_buckets(_meta(tensors), 0)


def test_checksum_is_bit_exact_and_order_sensitive():
    t = torch.randn(1000)
    same = t.clone()
    flipped = t.clone()
    flipped.view(torch.int32)[123] ^= 1  # one bit
    swapped = t.clone()
    swapped[[5, 6]] = swapped[[6, 5]]
    assert tensor_checksum(t) == tensor_checksum(same)
    assert tensor_checksum(t) != tensor_checksum(flipped)
    assert tensor_checksum(t) != tensor_checksum(swapped)
    assert tensor_checksum(t) != tensor_checksum(t.bfloat16())
    assert compare_checksums({"a": "1", "b": "2"}, {"a": "1", "b": "3"}, "r0") == ["r0: b differs (3 != 2)"]
    assert compare_checksums({"a": "1"}, {}, "r1") == ["r1: a not received"]
    assert rank_offsets([1, 2, 1]) == [1, 2, 4]


# ------------------------------------------------------------------------------------------ threads
def _run_group(world: int, bucket: int, double_buffer: bool, timeout: float = 20.0, receivers_that_receive=None):
    """Rank 0 sends _tensors(1) in threads; the others receive into fresh copies (like engines)."""
    tensors = _tensors(1)
    plan = plan_buckets(_meta(tensors), bucket)
    store, port = master_store("127.0.0.1", timeout)
    results: dict[int, object] = {}
    receiving = set(range(1, world)) if receivers_that_receive is None else set(receivers_that_receive)

    def member(rank: int):
        try:
            group = WeightSyncGroup("gloo", "127.0.0.1", port, rank, world, timeout,
                                    store=store if rank == 0 else None, name="t")
            group.handshake()
            if rank == 0:
                results[0] = send_buckets(group, plan, iter(tensors.items()), double_buffer=double_buffer, verify=True)
            elif rank in receiving:
                got, sums, sizes = {}, {}, []
                for views in receive_buckets(group, plan, double_buffer=double_buffer, verify=True, checksums=sums):
                    sizes.append(sum(v.numel() * v.element_size() for _, v in views))
                    got.update({n: v.clone() for n, v in views})  # the consumer copies before the next bucket
                results[rank] = (got, sums, sizes)
            else:
                time.sleep(timeout * 3)  # joined, then never takes part: a stuck peer
            group.close()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(world)]
    for th in threads:
        th.start()
    return tensors, plan, results, threads


@pytest.mark.parametrize("double_buffer", [True, False])
def test_broadcast_buckets_bit_exact_between_threads(double_buffer):
    tensors, plan, results, threads = _run_group(3, 4096, double_buffer)
    for th in threads:
        th.join(30)
    sender = results[0]
    assert not isinstance(sender, Exception), sender
    assert sender["buckets"] == len(plan) > 2
    for rank in (1, 2):
        assert not isinstance(results[rank], Exception), results[rank]
        got, sums, sizes = results[rank]
        assert sums == sender["checksums"]
        assert sizes == [sum(m.nbytes for m in b.tensors) for b in plan]  # each bucket as planned
        for name, t in tensors.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t)


def test_stuck_peer_times_out_instead_of_hanging():
    t0 = time.monotonic()
    _, _, results, threads = _run_group(3, 4096, True, timeout=3.0, receivers_that_receive=[1])
    threads[0].join(30)
    assert isinstance(results.get(0), Exception), results.get(0)  # the sender gave up
    assert time.monotonic() - t0 < 25


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("double_buffer", [True, False])
def test_nccl_broadcast_between_two_gpus_bit_exact(double_buffer):
    tensors = _tensors(3)
    plan = plan_buckets(_meta(tensors), 4096)
    store, port = master_store("127.0.0.1", 60)
    out: dict = {}

    def member(rank: int):
        torch.cuda.set_device(rank)
        group = WeightSyncGroup("nccl", "127.0.0.1", port, rank, 2, 60, store=store if rank == 0 else None, name="g")
        group.handshake()
        if rank == 0:
            out[0] = send_buckets(group, plan, ((n, t.cuda(0)) for n, t in tensors.items()),
                                  double_buffer=double_buffer, verify=True)
        else:
            sums, got = {}, {}
            for views in receive_buckets(group, plan, double_buffer=double_buffer, verify=True, checksums=sums):
                got.update({n: v.cpu() for n, v in views})
            out[1] = (sums, got)
        group.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    sums, got = out[1]
    assert sums == out[0]["checksums"]
    assert all(torch.equal(got[n], t) for n, t in tensors.items())


def test_local_engine_endpoint_loads_into_the_engine():
    """The native-engine path: the receive generator is consumed by engine.update_weights."""

    class Engine:  # what LocalEngineSide needs of an engine: update_weights(stream, version) and .model
        def __init__(self):
            self.model = torch.nn.Module()
            for name, t in _tensors(2).items():
                self.model.register_parameter(name.replace(".", "_"), torch.nn.Parameter(torch.zeros_like(t)))
            self.version = 0

        async def update_weights(self, stream, version):
            params = dict(self.model.named_parameters())
            for bucket in stream:
                for name, view in bucket:
                    params[name.replace(".", "_")].data.copy_(view)
            self.version = version

    tensors = _tensors(1)
    plan_wire = plan_to_wire(plan_buckets(_meta(tensors), 2048))
    store, port = master_store("127.0.0.1", 20)
    engine = Engine()
    endpoint = RolloutSide(SimpleNamespace(sync_engines=[engine]))
    sent: dict = {}

    def sender():
        group = WeightSyncGroup("gloo", "", 0, 0, 2, 20, store=store, name="e")
        group.handshake()
        sent.update(send_buckets(group, plan_from_wire(plan_wire), iter(tensors.items()), verify=True))

    async def receiver():
        assert await endpoint.ranks() == [1]
        await endpoint.join("127.0.0.1", port, 2, "gloo", 20, "e")
        out = await endpoint.receive(plan_wire, version=7, double_buffer=True, verify=True)
        await endpoint.leave()
        return out

    th = threading.Thread(target=sender, daemon=True)
    th.start()
    out = asyncio.run(receiver())
    th.join(20)
    assert engine.version == 7
    assert out["replica 0"]["checksums"] == sent["checksums"]
    params = dict(engine.model.named_parameters())
    for name, t in tensors.items():
        assert torch.equal(params[name.replace(".", "_")].data, t)
    with pytest.raises(SyncError, match="before join"):
        asyncio.run(LocalEngineSide(engine).receive(plan_wire, version=8))


# ------------------------------------------------------------------------------------------ Ray
@pytest.fixture(scope="module")
def trainer_and_replicas(ray_session, tiny_model_dir, tmp_path_factory):
    import ray

    from tests.trainer.trainer_helpers import compose_config
    from verl_async.models.tiny import build_tiny_model_dir
    from verl_async.trainer import FSDPWorkerGroup

    # The engines start from OTHER random weights: a sync that moved nothing would fail the checks.
    engine_dir = build_tiny_model_dir(str(tmp_path_factory.mktemp("engine_model")), seed=123)
    group = FSDPWorkerGroup(compose_config(tiny_model_dir, "trainer.n_gpus_per_node=2", "trainer.worker_timeout_s=120"),
                            name="test_sync_trainer")
    rollout_cfg = {"name": "native", "max_num_seqs": 2, "max_model_len": 64, "seed": 0}
    side = ray.remote(SyncTarget).options(num_cpus=0.1, max_concurrency=100).remote(2, rollout_cfg, engine_dir, "cpu")
    group.init()
    ray.get(side.weight_sync.remote("collective", "ranks"), timeout=120)
    try:
        yield group, side
    finally:
        group.shutdown()
        ray.kill(side)


def test_gloo_sync_with_ray_actors_is_bit_exact(trainer_and_replicas):
    import ray

    group, side = trainer_and_replicas
    bucket = 64 << 10
    sync = build_sync("gloo", group, side, bucket_bytes=bucket, timeout_s=60, verify=True)
    assert isinstance(sync, GlooCollectiveSync)
    reference = {name: tensor_checksum(t) for name, t in full_weights(group, 1 << 20)}
    m1 = sync.push(1)
    assert ray.get(side.state.remote(), timeout=30) == (1, 1)
    assert m1["sync/engine_ranks"] == 2.0 and m1["sync/verified_tensors"] == len(reference)
    assert m1["sync/buckets"] > 1 and m1["timing_s/param_sync"] > 0
    # where the seconds went: the gathers are part of the trainer's send; both sides took time within the sync
    assert 0 < m1["timing_s/sync_gather"] <= m1["timing_s/sync_send"] <= m1["timing_s/param_sync"]
    assert 0 < m1["timing_s/sync_receive_load"] <= m1["timing_s/param_sync"]
    # every replica received and LOADED (checksums of its own parameters) exactly the trainer's weights
    for who, got in sync.last["receivers"].items():
        assert got["checksums"] == reference, who
        assert got["loaded_checksums"] == reference, who
    plan = plan_from_wire(sync._plan)
    assert all(b.nbytes <= bucket or len(b.tensors) == 1 for b in plan)
    # second push reuses the group; single buffering gives the same bytes
    sync.double_buffer = False
    m2 = sync.push(2)
    assert m2["timing_s/sync_group_init"] == 0.0
    assert ray.get(side.state.remote(), timeout=30) == (2, 2)
    assert all(got["loaded_checksums"] == reference for got in sync.last["receivers"].values())
    # a new bucket size keeps the group
    sync.replan(1 << 30)
    m3 = sync.push(3)
    assert m3["timing_s/sync_group_init"] == 0.0 and m3["sync/buckets"] == 1.0
    # close() leaves on every member at once; a new group forms afterwards
    sync.close()
    again = build_sync("gloo", group, side, bucket_bytes=bucket, timeout_s=60, verify=True)
    m4 = again.push(4)
    assert m4["timing_s/sync_group_init"] > 0.0
    assert ray.get(side.state.remote(), timeout=30) == (4, 4)
    assert all(got["loaded_checksums"] == reference for got in again.last["receivers"].values())
    again.close()


def test_dead_replica_fails_with_a_clear_error(trainer_and_replicas):
    """Last: kills a replica."""
    import ray

    group, side = trainer_and_replicas
    sync = build_sync("gloo", group, side, bucket_bytes=64 << 10, timeout_s=8)
    sync.push(5)
    ray.get(side.kill_replica.remote(1), timeout=30)
    t0 = time.monotonic()
    with pytest.raises(SyncError, match=r"rollouter failed|did not finish"):
        sync.push(6)
    assert time.monotonic() - t0 < 30
    with pytest.raises(SyncError, match="unusable"):
        sync.push(7)


# The real pipeline with sync_transport=gloo: tests/test_pipeline_integration.py TestAsyncRun (its fully async run
# syncs over the gloo collective: test_every_sync_is_a_gloo_collective).
