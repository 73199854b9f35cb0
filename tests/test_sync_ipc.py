"""cuda_ipc transport (verl_async/sync/cuda_ipc.py): the pure parts on CPU; the GPU test is tests/test_sync_ipc_gpu.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from verl_async.config.derived import auto_sync_transport, cuda_ipc_problem
from verl_async.sync import DRIVERS, SyncError, build_sync, cuda_ipc
from verl_async.sync.buckets import bucket_view, metas_from_wire, metas_to_wire, plan_buckets, tensor_checksum
from verl_async.sync.cuda_ipc import (CudaIpcSync, RolloutSide, TrainerSide, ipc_metrics, ipc_problems, layout, pack,
                                      route_replicas, send_buckets_ipc, unpack)


def _pairs():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),        # 30 bytes: odd-ish size
        ("b.fp32", torch.randn(7, generator=g)),                               # 28 bytes
        ("c.fp16", torch.randn(1, generator=g).to(torch.float16)),             # 2 bytes
        ("d.empty", torch.zeros(0, 4)),                                        # 0 bytes
        ("e.i64", torch.arange(5, dtype=torch.int64)),
        ("f.bf16", torch.randn(2, 3, 4, generator=g).to(torch.bfloat16)),
        ("g.u8", torch.arange(3, dtype=torch.uint8)),
        ("h.fp32", torch.tensor(float("nan")).reshape(())),                    # a 0-d tensor, NaN bits kept
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


@pytest.mark.parametrize("align", [8, 256, 4096])
def test_layout_offsets_are_aligned_and_disjoint(align):
    pairs = _pairs()
    metas, nbytes = layout(pairs, align)
    assert [m.name for m in metas] == [n for n, _ in pairs]
    end = 0
    for (_, t), m in zip(pairs, metas):
        assert m.offset % align == 0 and m.offset >= end
        assert m.nbytes == t.numel() * t.element_size() and m.shape == tuple(t.shape)
        assert m.dtype == str(t.dtype).removeprefix("torch.")
        end = m.offset + m.nbytes
    assert nbytes == end
    with pytest.raises(ValueError, match="multiple of 8"):
        layout(pairs, 6)


@pytest.mark.parametrize("align", [8, 256])
def test_pack_unpack_round_trip_is_bit_exact(align):
    pairs = _pairs()
    buffer, metas = pack(pairs, align=align)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.numel() >= layout(pairs, align)[1]
    back = unpack(buffer, metas_from_wire(metas_to_wire(metas)))  # the layout as it travels
    assert [n for n, _ in back] == [n for n, _ in pairs]
    for (_, t), (_, v) in zip(pairs, back):
        assert v.dtype == t.dtype and v.shape == t.shape
        assert torch.equal(_bits(v), _bits(t))
        if v.numel():
            assert v.data_ptr() % v.element_size() == 0
            assert v.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, no copy
    # views write through to the buffer (the engine only reads them, but they are views)
    m = metas[0]
    bucket_view(buffer, m).fill_(0)
    assert int(buffer[m.offset: m.offset + m.nbytes].sum()) == 0


def test_pack_of_nothing_and_of_large_odd_sizes():
    buffer, metas = pack([], align=256)
    assert metas == [] and buffer.numel() == 1
    big = [("x", torch.randn(1001, 3).to(torch.bfloat16)), ("y", torch.randn(17)), ("z", torch.randn(3).half())]
    buffer, metas = pack(big)
    assert [m.offset for m in metas] == [0, 6144, 6144 + 256]
    for (_, t), (_, v) in zip(big, unpack(buffer, metas)):
        assert torch.equal(_bits(v), _bits(t))


def test_transport_is_registered():
    assert DRIVERS["cuda_ipc"] is CudaIpcSync
    sync = build_sync("cuda_ipc", object(), object(), bucket_bytes=1 << 20, timeout_s=5)
    assert isinstance(sync, CudaIpcSync) and sync.bucket_bytes == 1 << 20


# ---------------------------------------------------------------------------------- which rank serves which replica
G = [f"{c * 8}-1111-2222-3333-444444444444" for c in "abcd"]  # four GPUs' UUIDs


def test_each_replica_is_served_by_the_rank_on_its_gpu():
    assert route_replicas(G[:2], {0: G[0], 1: G[1]}) == {0: [0], 1: [1]}
    # Ray need not give rank i the node's device i: the UUIDs decide
    assert route_replicas([G[1], G[0]], {0: G[0], 1: G[1]}) == {0: [1], 1: [0]}
    # fewer replicas than ranks (the one-replica path beside a 2-rank trainer): the other rank only gathers
    assert route_replicas(G[:2], {0: G[0]}) == {0: [0], 1: []}
    assert route_replicas(G[:4], {3: G[2], 0: G[0]}) == {0: [0], 1: [], 2: [3], 3: []}  # replicas by index
    assert route_replicas(G[:2], {}) == {0: [], 1: []}


def test_a_replica_on_a_gpu_without_a_rank_names_the_keys():
    with pytest.raises(SyncError) as err:
        route_replicas(G[:2], {0: G[0], 1: G[2]})
    text = str(err.value)
    assert "engine replica 1 runs on GPU cccccccc," in text and "rank 0 on aaaaaaaa, rank 1 on bbbbbbbb" in text
    assert "trainer.n_gpus_per_node" in text and "async_training.sync_transport=object_store" in text
    with pytest.raises(SyncError, match="trainer ranks 0 and 1 report the same GPU"):
        route_replicas([G[0], G[0]], {0: G[0]})


# ------------------------------------------------------------------------------------------ the config's answer
def _cfg(**changes):
    """A hand-made config holding only the keys cuda_ipc_problem and auto_sync_transport read: 2 colocated
    FSDP2 ranks + 2 native replicas on CUDA, changed by dotted keys."""
    cfg = OmegaConf.create({
        "trainer": {"device": "cuda", "nnodes": 1, "n_gpus_per_node": 2},
        "rollout": {"colocate": True, "nnodes": 1, "n_gpus_per_node": 2},
        "actor_rollout_ref": {"rollout": {"name": "native", "tensor_model_parallel_size": 1},
                              "actor": {"strategy": "fsdp2"}},
    })
    for key, value in changes.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return cfg


@pytest.mark.parametrize("changes,words", [
    ({}, None),
    ({"trainer__n_gpus_per_node": 1, "rollout__n_gpus_per_node": 1}, None),  # the one-GPU path, as before
    ({"rollout__n_gpus_per_node": 1}, None),  # one replica beside a 2-rank trainer
    ({"trainer__n_gpus_per_node": 8, "rollout__n_gpus_per_node": 8}, None),
    ({"rollout__colocate": False}, "cuda_ipc needs rollout.colocate=true"),
    ({"actor_rollout_ref__rollout__name": "vllm"}, "actor_rollout_ref.rollout.name=vllm"),
    ({"actor_rollout_ref__actor__strategy": "megatron"}, "actor_rollout_ref.actor.strategy=megatron"),
    ({"actor_rollout_ref__rollout__tensor_model_parallel_size": 2},
     "set actor_rollout_ref.rollout.tensor_model_parallel_size=1, got 2"),
    ({"trainer__nnodes": 2}, "set trainer.nnodes=1 and rollout.nnodes=1, got 2 and 1"),
    ({"trainer__n_gpus_per_node": 1}, "rollout.n_gpus_per_node=2 replicas need as many trainer GPUs, "
                                      "trainer.n_gpus_per_node=1"),
])
def test_cuda_ipc_problem_names_the_keys_and_auto_follows_it(changes, words):
    cfg = _cfg(**changes)
    problem = cuda_ipc_problem(cfg)
    if words is None:
        assert problem is None and auto_sync_transport(cfg) == "cuda_ipc"
    else:
        assert words in problem and "\n" not in problem
        assert auto_sync_transport(cfg) == ("nccl" if not cfg.rollout.colocate else "object_store")
    cfg.trainer.device = "cpu"
    assert auto_sync_transport(cfg) == "object_store"


# ------------------------------------------------------------------------------------------ the rollout side
class _Replica:
    """A replica proxy (`RemoteEngine`'s shape): its index, and `weight_sync` forwarded to its actor."""

    def __init__(self, index, gpu):
        self.index, self.gpu, self.got = index, gpu, []

    async def weight_sync(self, transport, step, *args, **kwargs):
        assert transport == "cuda_ipc"
        if step == "gpu":
            return self.gpu
        payload = args[0]
        self.got.append((payload["handles"], kwargs["version"]))
        return {"ok": self.index}


def test_rollout_side_reports_gpus_and_gives_only_the_named_replicas_their_export():
    replicas = [_Replica(0, G[0]), _Replica(2, G[1])]  # replica 1 is out of rotation
    side = RolloutSide(SimpleNamespace(sync_engines=replicas))
    assert asyncio.run(side.gpus()) == {0: G[0], 2: G[1]}
    out = asyncio.run(side.load({"layout": [], "nbytes": 1, "handles": {2: "h2"}}, version=3))
    assert out == {"replica 2": {"ok": 2}}
    assert replicas[0].got == [] and replicas[1].got == [(["h2"], 3)]
    out = asyncio.run(side.load({"layout": [], "nbytes": 1, "handles": {0: "h0", 2: "h2b"}}, version=4))
    assert out == {"replica 0": {"ok": 0}, "replica 2": {"ok": 2}} and replicas[0].got == [(["h0"], 4)]
    with pytest.raises(SyncError, match=r"replica\(s\) \[1\] are not in this sync"):
        asyncio.run(side.load({"layout": [], "nbytes": 1, "handles": {1: "h1"}}, version=5))


# ---------------------------------------------------------------------------------- a rank's sender (host buffers)
def _model():
    g = torch.Generator().manual_seed(1)
    shapes = [(300,), (7, 11), (64,), (5, 40), (1,), (90,)]
    return [(f"w{i}", torch.randn(s, generator=g).to(torch.bfloat16)) for i, s in enumerate(shapes)]


class _Target:
    """The rollout side as a trainer rank sees it: `weight_sync.remote` returns a 'ref' (the call itself)."""

    def __init__(self, events):
        self.events, self.calls = events, 0
        target = self

        class _Method:
            @staticmethod
            def remote(transport, step, payload, *, version):
                assert (transport, step, version) == ("cuda_ipc", "load", 7)
                index = target.calls
                target.calls += 1
                target.events.append(("submit", index))
                return ("ref", index, payload)

        self.weight_sync = _Method


def _fake_ray_get(model, events):
    def get(ref, timeout):
        _, index, payload = ref
        metas = metas_from_wire(payload["layout"])
        result = {}
        for replica, buffer in payload["handles"].items():  # what the replica reads now: its bucket, intact
            got = {n: tensor_checksum(v) for n, v in unpack(buffer, metas)}
            assert got == {n: tensor_checksum(model[n]) for n in got}, f"bucket {index} overwritten before loaded"
            result[f"replica {replica}"] = {"checksums": got, "loaded_checksums": got, "seconds": 0.25}
        events.append(("loaded", index))
        return result
    return get


@pytest.mark.parametrize("double_buffer", [True, False])
def test_sender_fills_each_bucket_while_the_previous_loads_and_never_overwrites_one_in_use(monkeypatch, double_buffer):
    pairs = _model()
    model = dict(pairs)
    plan = plan_buckets(((n, t.dtype, t.shape) for n, t in pairs), bucket_bytes=700)
    assert len(plan) >= 3
    events: list = []
    bucket_of = {m.name: i for i, b in enumerate(plan) for m in b.tensors}

    def stream():
        for name, t in pairs:
            events.append(("gather", bucket_of[name]))
            yield name, t

    monkeypatch.setattr(cuda_ipc, "export", lambda buffer: buffer)
    monkeypatch.setattr(cuda_ipc.ray, "get", _fake_ray_get(model, events))
    out = send_buckets_ipc(plan, stream(), _Target(events), [0, 1], 7, timeout_s=5, verify=True,
                           double_buffer=double_buffer, device="cpu")
    assert out["buckets"] == len(plan) and out["bytes"] == sum(t.numel() * 2 for t in model.values())
    assert out["checksums"] == {n: tensor_checksum(t) for n, t in pairs}
    assert set(out["receivers"]) == {"replica 0", "replica 1"}
    assert out["receivers"]["replica 1"]["seconds"] == pytest.approx(0.25 * len(plan))
    loads = [e for e in events if e[0] != "gather"]
    assert loads == [(kind, i) for i in range(len(plan)) for kind in ("submit", "loaded")]  # one load at a time
    first_gather_of_1 = events.index(("gather", 1))
    if double_buffer:  # bucket 1 is gathered and filled while bucket 0 loads
        assert events.index(("submit", 0)) < first_gather_of_1 < events.index(("loaded", 0))
    else:  # one buffer: bucket 0 must be loaded before bucket 1 is written into it
        assert events.index(("loaded", 0)) < first_gather_of_1


def test_a_rank_without_replicas_only_gathers_and_a_plan_mismatch_fails(monkeypatch):
    pairs = _model()
    plan = plan_buckets(((n, t.dtype, t.shape) for n, t in pairs), bucket_bytes=700)
    seen = []
    out = send_buckets_ipc(plan, ((seen.append(n), (n, t))[1] for n, t in pairs), None, [], 7, timeout_s=5)
    assert seen == [n for n, _ in pairs] and out["buckets"] == 0 and out["receivers"] == {}
    monkeypatch.setattr(cuda_ipc, "export", lambda buffer: buffer)
    monkeypatch.setattr(cuda_ipc.ray, "get", _fake_ray_get(dict(pairs), []))
    renamed = [("other" if n == "w2" else n, t) for n, t in pairs]
    with pytest.raises(SyncError, match="plan expects 'w2'"):
        send_buckets_ipc(plan, iter(renamed), _Target([]), [0], 7, timeout_s=5, device="cpu")
    with pytest.raises(SyncError, match="tensor 'extra' that the plan does not list"):
        send_buckets_ipc(plan, iter(pairs + [("extra", torch.zeros(1))]), _Target([]), [0], 7, timeout_s=5,
                         device="cpu")


class _Rank:
    """What TrainerSide needs of a trainer rank (on host memory here)."""

    def __init__(self, rank, pairs, fail_at=None):
        self.rank, self.pairs, self.fail_at = rank, pairs, fail_at
        self.settings = SimpleNamespace(device="cuda")
        self.device = SimpleNamespace(torch_device=torch.device("cpu"))
        self.asked, self.iterated = None, 0

    def sync_dtype(self, dtype=None):
        return torch.bfloat16

    def full_param_shapes(self):
        return [(n, tuple(t.shape)) for n, t in self.pairs]

    def iter_full_params(self, dtype, *, to_cpu=True, every_rank=False):
        self.asked = (dtype, to_cpu, every_rank)
        for name, t in self.pairs:
            self.iterated += 1
            yield ("bad" if name == self.fail_at else name), t


def test_trainer_side_serves_its_own_replicas_and_finishes_the_gathers_on_failure(monkeypatch):
    pairs = _model()
    events: list = []
    monkeypatch.setattr(cuda_ipc, "export", lambda buffer: buffer)
    monkeypatch.setattr(cuda_ipc.ray, "get", _fake_ray_get(dict(pairs), events))
    routes = {0: [], 1: [0, 3]}
    idle, serving = _Rank(0, pairs), _Rank(1, pairs)
    out = TrainerSide(idle).send(_Target(events), routes, 7, 700, 5)
    assert idle.asked == (torch.bfloat16, False, False) and idle.iterated == len(pairs) and out["buckets"] == 0
    out = TrainerSide(serving).send(_Target(events), routes, 7, 700, 5, verify=True)
    assert serving.asked == (torch.bfloat16, False, True)  # rank 1 needs its own copy of each gathered tensor
    assert out["replicas"] == [0, 3] and set(out["receivers"]) == {"replica 0", "replica 3"} and out["seconds"] >= 0
    broken = _Rank(1, pairs, fail_at="w1")
    with pytest.raises(SyncError, match="plan expects 'w1'"):
        TrainerSide(broken).send(_Target([]), routes, 7, 700, 5)
    assert broken.iterated == len(pairs)  # the other ranks are not left waiting in a gather
    with pytest.raises(SyncError, match="needs trainer.device=cuda"):
        cpu_rank = _Rank(0, pairs)
        cpu_rank.settings.device = "cpu"
        TrainerSide(cpu_rank).send(_Target([]), routes, 7, 700, 5)


# ------------------------------------------------------------------------------------------ the driver
def test_metrics_and_bit_checks_over_two_serving_ranks():
    sums = {"a": "x", "b": "y"}
    senders = {
        0: {"buckets": 3, "bytes": 900, "seconds": 0.4, "gather_s": 0.1, "wait_s": 0.2, "checksums": sums,
            "receivers": {"replica 0": {"checksums": sums, "loaded_checksums": sums, "seconds": 0.3}}},
        1: {"buckets": 3, "bytes": 900, "seconds": 0.5, "gather_s": 0.15, "wait_s": 0.25, "checksums": sums,
            "receivers": {"replica 1": {"checksums": sums, "loaded_checksums": {"a": "x", "b": "z"}, "seconds": 0.35}}},
        2: {"buckets": 0, "bytes": 0, "seconds": 0.45, "receivers": {}},
    }
    routes = {0: [0], 1: [1], 2: []}
    m = ipc_metrics(senders, routes, 0.6)
    assert m == {"sync/buckets": 3.0, "sync/bytes": 900.0, "sync/replicas": 2.0, "sync/gbps": pytest.approx(1.5e-6),
                 "timing_s/sync_gather": 0.15, "timing_s/sync_send": 0.5, "timing_s/sync_wait_load": 0.25,
                 "timing_s/sync_receive_load": 0.35}
    assert ipc_problems(senders, routes) == ["replica 1: b differs (z != y) (after load)"]
    senders[0]["receivers"] = {}
    assert "replica 0: a not received" in ipc_problems(senders, routes)
    assert ipc_metrics(senders, {0: [], 1: [], 2: []}, 0.6)["sync/replicas"] == 0.0


def test_push_asks_the_gpus_routes_and_keeps_the_pause_resume_protocol(monkeypatch):
    """CudaIpcSync is the drivers' push with its own transfer: pause, routes, every rank sends, resume."""

    calls = []

    class Remote:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def remote(self, *args, **kwargs):
            calls.append(self.name if self.name else args[1])  # weight_sync: named by its step
            return self.fn(*args)

    class Rollouter:
        pause_for_sync = Remote("pause", lambda: None)
        resume_after_sync = Remote("resume", lambda v: v)
        weight_sync = Remote("", lambda transport, step: {"gpus": {0: G[1], 1: G[0]}, "unwritten": {}}[step])

    sent = {"buckets": 3, "bytes": 99, "seconds": 0.1, "gather_s": 0.05, "wait_s": 0.01, "checksums": {},
            "receivers": {}}

    class Group:
        def weight_sync_refs(self, transport, step, *args):
            assert transport == "cuda_ipc"
            if step == "gpu":
                calls.append("gpu")
                return [G[0], G[1]]
            target, routes, version, bucket_bytes, timeout_s, verify, double_buffer = args
            calls.append((step, routes, version, bucket_bytes, double_buffer))
            return [sent, sent]

    monkeypatch.setattr(CudaIpcSync, "wait", lambda self, refs, what: dict(refs))  # the refs are the results here
    sync = CudaIpcSync(Group(), Rollouter(), bucket_bytes=64, timeout_s=5, double_buffer=False)
    out = sync.push(4, while_paused=lambda: calls.append("val") or {"val/x": 1.0})
    sync.push(5)
    routes = {0: [1], 1: [0]}  # rank 0 holds the GPU of replica 1
    assert calls[:7] == ["pause", "gpu", "gpus", ("send", routes, 4, 64, False), "unwritten", "val", "resume"]
    assert calls[7:] == ["pause", "gpus", ("send", routes, 5, 64, False), "unwritten", "resume"]  # ranks asked once
    assert out["sync/buckets"] == 3.0 and out["sync/replicas"] == 2.0 and out["val/x"] == 1.0
    assert out["timing_s/sync_gather"] == 0.05 and "timing_s/param_sync" in out


def test_every_rank_yields_its_own_gathered_copy_only_when_asked():
    """FSDPWorker.iter_full_params: rank 0 alone by default (object store, collective); `every_rank` on every rank
    (cuda_ipc: the rank on a replica's GPU serves it). Driven on a stand-in rank: plain parameters, no gather."""
    from verl_async.trainer.fsdp_worker import FSDPWorker

    model = torch.nn.Linear(3, 2)

    def rank(index):
        me = SimpleNamespace(rank=index, model=model, settings=SimpleNamespace(lora=None),
                             device=SimpleNamespace(torch_device=torch.device("cpu")),
                             _load_if_offloaded=lambda: None, _offload_if_asked=lambda: None)
        me._gathered_params = lambda every_rank=False: FSDPWorker._gathered_params(me, every_rank)
        return me

    def names(index, **kwargs):
        return [n for n, _ in FSDPWorker.iter_full_params(rank(index), torch.bfloat16, to_cpu=False, **kwargs)]

    assert names(0) == names(0, every_rank=True) == names(1, every_rank=True) == ["weight", "bias"]
    assert names(1) == []
    (_, w), _ = FSDPWorker.iter_full_params(rank(1), torch.bfloat16, to_cpu=False, every_rank=True)
    assert w.dtype == torch.bfloat16 and torch.equal(w, model.weight.detach().to(torch.bfloat16))
