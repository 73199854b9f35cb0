import asyncio

import pytest

from verl_async.protocol import Response, RolloutSample
from verl_async.queue import MessageQueue, QueueClosed
from verl_async.staleness import StalenessBudget, exceeds_max_staleness, max_required_samples


def _group(uid: str, n: int = 2) -> RolloutSample:
    return RolloutSample(uid, [1], [Response([2], [-0.1], [0], "stop") for _ in range(n)])


def test_fifo_and_counts():
    async def go():
        q = MessageQueue(capacity=4, group_size=2)
        for i in range(3):
            await q.put(_group(str(i)))
        got = await q.get_batch(2, timeout=1)
        assert [g.uid for g in got] == ["0", "1"]
        st = q.stats()
        assert (st.size, st.produced, st.consumed) == (1, 3, 2)

    asyncio.run(go())


def test_back_pressure_never_drops():
    async def go():
        q = MessageQueue(capacity=2)
        await q.put(_group("a"))
        await q.put(_group("b"))
        with pytest.raises(TimeoutError):
            await q.put(_group("c"), timeout=0.05)
        blocked = asyncio.create_task(q.put(_group("c")))
        await asyncio.sleep(0.05)
        assert not blocked.done() and q.size() == 2
        got = await q.get_batch(1, timeout=1)
        await asyncio.wait_for(blocked, 1)
        assert [g.uid for g in got] == ["a"]
        assert [g.uid for g in await q.get_batch(2, timeout=1)] == ["b", "c"]
        assert q.stats().produced == 3

    asyncio.run(go())


def test_get_timeout_takes_nothing():
    async def go():
        q = MessageQueue(capacity=4)
        await q.put(_group("a"))
        with pytest.raises(TimeoutError):
            await q.get_batch(2, timeout=0.05)
        assert q.size() == 1

    asyncio.run(go())


def test_close_releases_waiters_and_refuses_puts():
    async def go():
        q = MessageQueue(capacity=4)
        await q.put(_group("a"))
        waiter = asyncio.create_task(q.get_batch(3, timeout=5))
        await asyncio.sleep(0.02)
        await q.close()
        assert [g.uid for g in await waiter] == ["a"]
        with pytest.raises(QueueClosed):
            await q.put(_group("b"))

    asyncio.run(go())


def test_partial_group_refused():
    async def go():
        q = MessageQueue(capacity=4, group_size=3)
        with pytest.raises(ValueError, match="expected rollout.n=3"):
            await q.put(_group("a", n=2))
        assert q.size() == 0

    asyncio.run(go())


def test_snapshot_restore_keeps_order():
    async def go():
        q = MessageQueue(capacity=8)
        for i in range(3):
            await q.put(_group(str(i)))
        snap = q.snapshot()
        q2 = MessageQueue(capacity=8)
        await q2.put(_group("new"))
        await q2.restore(snap)
        assert [g.uid for g in await q2.get_batch(4, timeout=1)] == ["0", "1", "2", "new"]

    asyncio.run(go())


def test_max_required_samples_formula():
    assert max_required_samples(4, 1, 0.0) == 4
    assert max_required_samples(4, 2, 0.5) == 12
    assert max_required_samples(64, 4, 0.2) == 307  # 64*4*1.2 = 307.2
    assert max_required_samples(3, 1, 1 / 3) == 4
    with pytest.raises(ValueError):
        max_required_samples(0, 1, 0)


def test_budget_resets_to_outstanding():
    b = StalenessBudget(limit=3)
    for _ in range(3):
        assert b.can_start()
        b.on_start()
    assert not b.can_start()
    b.on_sync(outstanding=2)
    assert b.remaining == 1
    assert exceeds_max_staleness(5, 2, 2) and not exceeds_max_staleness(5, 3, 2)
    assert not exceeds_max_staleness(9, 0, None)
