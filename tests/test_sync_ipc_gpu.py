"""cuda_ipc on CUDA: a bucket mapped in another process, a real trainer rank -> colocated native replica on one GPU,
and 2 FSDP2 ranks -> 2 colocated native replicas on two GPUs (each replica served by the rank on its GPU).

Run on a CUDA machine (skipped without one, like every `gpu` test; the 2-GPU test needs 2 GPUs, `multigpu`):
    PYTHONPATH=. python -m pytest -q -s -p no:cacheprovider tests/test_sync_ipc_gpu.py
`-s` shows the object_store vs cuda_ipc push times of the ~0.5B model (printed, never asserted).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time

import pytest
import torch

from verl_async.sync.buckets import metas_to_wire, tensor_checksum
from verl_async.sync.cuda_ipc import export, load_ipc_bucket, pack
from verl_async.sync.object_store import full_weights

pytestmark = pytest.mark.gpu


def _pairs(device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (1001,), (7, 3), (1,), (64, 129)]
    out = [(f"w{i}", torch.randn(s, generator=g).to(torch.bfloat16).to(device)) for i, s in enumerate(shapes)]
    out.append(("f32", torch.randn(13, generator=g).to(device)))
    return out


class _Engine:
    """What load_ipc_bucket needs of an engine: update_weights(stream, version) and `.model` (the native engine's loader)."""

    def __init__(self, pairs_meta: list[tuple[str, torch.dtype, tuple]]) -> None:
        from verl_async.rollout.native.weights import WeightLoader

        self.model = torch.nn.Module()
        for name, dtype, shape in pairs_meta:
            self.model.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device="cuda"),
                                                                   requires_grad=False))
        self.loader = WeightLoader(self.model)
        self.version = 0

    async def update_weights(self, stream, version):
        self.loader.load(stream)
        self.version = version


def _receive(payload: dict, pairs_meta: list, queue) -> None:  # runs in a spawned process
    try:
        engine = _Engine(pairs_meta)
        out = asyncio.run(load_ipc_bucket(engine, payload, 5))
        out["version"] = engine.version
        queue.put(out)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put({"error": repr(exc)})


def test_exported_bucket_maps_in_another_process_bit_exact_and_is_freed():
    torch.cuda.init()
    pairs = _pairs("cuda")
    reference = {n: tensor_checksum(t) for n, t in pairs}
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in pairs]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    buffer, metas = pack(pairs)
    layout_wire = metas_to_wire(metas)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    for _ in range(2):  # two receivers: one export (one ref-counter slot) each
        payload = {"layout": layout_wire, "nbytes": int(buffer.numel()), "handles": [export(buffer)], "verify": True}
        procs.append(ctx.Process(target=_receive, args=(payload, meta, queue)))
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
    for out in results:
        assert "error" not in out, out["error"]
        assert out["version"] == 5
        assert out["checksums"] == reference
        assert out["loaded_checksums"] == reference
    del buffer, payload
    torch.cuda.ipc_collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base  # both receivers released their slot: the buffer was freed


# ------------------------------------------------------------------------------------------ Ray, ~0.5B model
DIMS = dict(hidden_size=1024, num_layers=32, num_heads=16, num_kv_heads=4, intermediate_size=4096,
            max_position_embeddings=256)  # ~0.49B parameters
ROLLOUT_CFG = {"name": "native", "max_num_seqs": 2, "max_model_len": 64, "seed": 0, "enforce_eager": True}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    from verl_async.models.tiny import build_tiny_model_dir

    trainer_dir = build_tiny_model_dir(str(tmp_path_factory.mktemp("ipc_trainer_model")), seed=0, **DIMS)
    # the engine starts from OTHER random weights: a sync that moved nothing fails the checks
    engine_dir = build_tiny_model_dir(str(tmp_path_factory.mktemp("ipc_engine_model")), seed=123, **DIMS)
    return trainer_dir, engine_dir


def _colocated(model_dirs: tuple[str, str], gpus: int):
    """`gpus` FSDP2 ranks and as many native replicas, sharing the GPUs the way rollout.colocate=true does: each
    replica asks Ray for no GPU and pins device i."""
    import ray

    from tests.trainer.trainer_helpers import compose_config
    from verl_async.rollout.replica import SyncTarget
    from verl_async.trainer import FSDPWorkerGroup

    trainer_dir, engine_dir = model_dirs
    group = FSDPWorkerGroup(compose_config(trainer_dir, "trainer.device=cuda", f"trainer.n_gpus_per_node={gpus}",
                                           "trainer.worker_timeout_s=600"), name=f"test_ipc_trainer{gpus}")
    group.init()
    # num_cpus=0: the session's 4 CPUs hold the ranks and the replicas (1 each)
    side = ray.remote(SyncTarget).options(num_cpus=0, max_concurrency=100).remote(
        gpus, ROLLOUT_CFG, engine_dir, "cuda", shared_devices=[str(i) for i in range(gpus)], timeout_s=600)
    try:
        ray.get(side.weight_sync.remote("cuda_ipc", "gpus"), timeout=600)
        yield group, side
    finally:
        group.shutdown()
        ray.kill(side)


def _timings(group, side, ipc, version: int, rounds: int = 3) -> tuple[int, dict[str, list[float]]]:
    """The same weights again through object_store and cuda_ipc, alternating (printed; no timed assertion)."""
    from verl_async.sync import build_sync

    store = build_sync("object_store", group, side, bucket_bytes=256 << 20, timeout_s=300)
    ipc.verify = False
    times: dict[str, list[float]] = {"object_store": [], "cuda_ipc": []}
    for _ in range(rounds):
        for name, sync in (("object_store", store), ("cuda_ipc", ipc)):
            version += 1
            t0 = time.perf_counter()
            out = sync.push(version)
            times[name].append(time.perf_counter() - t0)
            assert out["timing_s/param_sync"] > 0
    return version, times


def _line(times: dict[str, list[float]]) -> str:
    return ", ".join(f"{k} median {statistics.median(v):.3f}s (runs {', '.join(f'{x:.3f}' for x in v)})"
                     for k, v in times.items())


@pytest.fixture  # not module-wide: the 2-GPU test below needs this one's GPU back
def colocated(ray_session, model_dirs):
    yield from _colocated(model_dirs, 1)


def test_cuda_ipc_push_to_a_colocated_native_replica_is_bit_exact(colocated):
    import ray

    from verl_async.sync import build_sync

    group, side = colocated
    reference = {name: tensor_checksum(t) for name, t in full_weights(group, 256 << 20)}
    params = sum(1 for _ in reference)
    before = ray.get(side.loaded_checksums.remote(), timeout=120)["replica 0"]
    assert set(reference) <= set(before) and any(before[n] != reference[n] for n in reference)

    ipc = build_sync("cuda_ipc", group, side, bucket_bytes=256 << 20, timeout_s=300, verify=True)
    m = ipc.push(1)
    assert ray.get(side.state.remote(), timeout=30) == (1, 1)
    assert m["sync/buckets"] >= 2
    assert ipc.last["checksums"] == reference
    got = ipc.last["receivers"]["replica 0"]
    assert got["checksums"] == reference and got["loaded_checksums"] == reference
    after = ray.get(side.loaded_checksums.remote(), timeout=120)["replica 0"]
    assert {n: after[n] for n in reference} == reference, "the engine's parameters differ from the trainer's"

    version, times = _timings(group, side, ipc, 1)
    assert ray.get(side.state.remote(), timeout=30) == (version, version)
    after = ray.get(side.loaded_checksums.remote(), timeout=120)["replica 0"]
    assert {n: after[n] for n in reference} == reference
    print(f"\ncolocated push of {params} tensors (~0.49B params, bf16, 256 MiB buckets) on one GPU: {_line(times)}",
          flush=True)


# ------------------------------------------------------------------------------------------ Ray, 2 GPUs, 2 + 2
@pytest.fixture
def colocated_pairs(ray_session, model_dirs):
    yield from _colocated(model_dirs, 2)


@pytest.mark.multigpu
def test_cuda_ipc_push_from_two_ranks_to_two_colocated_replicas_is_bit_exact(colocated_pairs):
    import ray

    from verl_async.sync import build_sync

    group, side = colocated_pairs
    reference = {name: tensor_checksum(t) for name, t in full_weights(group, 256 << 20)}
    before = ray.get(side.loaded_checksums.remote(), timeout=120)
    for who in ("replica 0", "replica 1"):
        assert set(reference) <= set(before[who]) and any(before[who][n] != reference[n] for n in reference)

    ipc = build_sync("cuda_ipc", group, side, bucket_bytes=256 << 20, timeout_s=300, verify=True)
    m = ipc.push(1)
    routes = ipc.last["routes"]
    assert sorted(routes) == [0, 1] and sorted(len(r) for r in routes.values()) == [1, 1]  # one replica per rank
    assert sorted(routes[0] + routes[1]) == [0, 1]
    for rank in (0, 1):  # both ranks packed and shipped every bucket to the replica on their GPU
        sent = ipc.last["senders"][rank]
        assert sent["buckets"] == m["sync/buckets"] >= 2 and sent["checksums"] == reference
        (replica,) = routes[rank]
        got = sent["receivers"][f"replica {replica}"]
        assert got["checksums"] == reference and got["loaded_checksums"] == reference
    assert m["sync/replicas"] == 2.0 and m["timing_s/sync_receive_load"] > 0
    after = ray.get(side.loaded_checksums.remote(), timeout=120)
    for who in ("replica 0", "replica 1"):
        assert {n: after[who][n] for n in reference} == reference, f"{who}'s parameters differ from the trainer's"
    assert ray.get(side.state.remote(), timeout=30) == (1, 1)

    version, times = _timings(group, side, ipc, 1)
    after = ray.get(side.loaded_checksums.remote(), timeout=120)
    assert all({n: after[who][n] for n in reference} == reference for who in ("replica 0", "replica 1"))
    print(f"\ncolocated push, 2 ranks -> 2 replicas on 2 GPUs (~0.49B params, bf16, 256 MiB buckets): "
          f"{_line(times)}; last cuda_ipc phases: "
          + ", ".join(f"{k} {v:.3f}" for k, v in ipc.last["metrics"].items() if k.startswith("timing_s/")), flush=True)
