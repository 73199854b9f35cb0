"""cuda_ipc transport (verl_async/sync/cuda_ipc.py): the pure parts on CPU; the GPU test is tests/test_sync_ipc_gpu.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from types import SimpleNamespace

from verl_async.sync import DRIVERS, SyncError, build_sync
from verl_async.sync.buckets import bucket_view, metas_from_wire, metas_to_wire
from verl_async.sync.cuda_ipc import CudaIpcSync, RolloutSide, layout, pack, unpack


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


def test_endpoint_gives_each_replica_its_own_export():
    class Engine:  # a replica proxy: forwards the step to its actor
        def __init__(self):
            self.got = None

        async def weight_sync(self, transport, step, payload, *, version):
            assert (transport, step) == ("cuda_ipc", "load")
            self.got = (payload["handles"], version)
            return {"ok": 1}

    engines = [Engine(), Engine()]
    ep = RolloutSide(SimpleNamespace(sync_engines=engines))
    assert asyncio.run(ep.receivers()) == 2
    out = asyncio.run(ep.load({"layout": [], "nbytes": 1, "handles": ["h0", "h1"]}, version=3))
    assert out == {"replica 0": {"ok": 1}, "replica 1": {"ok": 1}}
    assert engines[0].got == (["h0"], 3) and engines[1].got == (["h1"], 3)
    with pytest.raises(SyncError, match="1 export"):
        asyncio.run(ep.load({"layout": [], "nbytes": 1, "handles": ["h0"]}, version=3))


def test_push_keeps_the_pause_resume_protocol(monkeypatch):
    """CudaIpcSync is the drivers' push with its own transfer: pause, every bucket, while_paused, resume."""

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
        weight_sync = Remote("", lambda transport, step: {"receivers": 1, "unwritten": {}}[step])

    class Group:
        def weight_sync_refs(self, transport, step, target, receivers, version, bucket_bytes, timeout_s, verify):
            calls.append((step, receivers, version, bucket_bytes))
            return [{"buckets": 3, "bytes": 99, "receivers": {}}]

    monkeypatch.setattr(CudaIpcSync, "wait", lambda self, refs, what: dict(refs))  # the refs are the results here
    sync = CudaIpcSync(Group(), Rollouter(), bucket_bytes=64, timeout_s=5)
    out = sync.push(4, while_paused=lambda: calls.append("val") or {"val/x": 1.0})
    sync.push(5)
    assert calls[:6] == ["pause", "receivers", ("send", 1, 4, 64), "unwritten", "val", "resume"]
    assert calls[6:] == ["pause", ("send", 1, 5, 64), "unwritten", "resume"]  # the replica count is asked once
    assert out["sync/buckets"] == 3.0 and out["val/x"] == 1.0 and "timing_s/param_sync" in out
