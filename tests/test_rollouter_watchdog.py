"""The progress watchdog: a wedged engine stops the run, naming the replica and the requests it holds.

A wedged engine (accepts requests, never answers) hung the run for ever: the Rollouter waited
on its requests and the trainer's deadlock check stays quiet while groups are in flight. Slow
engines that still produce tokens, weight syncs and staleness-budget pauses must not trip it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from tests.fakes import FakeEngine
from tests.test_rollout_service_faults import _service, data_files  # noqa: F401 (a fixture)
from tests.test_rollouter import make, run_pipeline
from verl_async.rollout.engine import DelegatingEngine, EngineStats, GenerateRequest, GenerateResult
from verl_async.rollout.watchdog import (
    EngineStalled,
    ProgressWatchdog,
    StallClock,
    default_progress_timeout_s,
    progress_timeout_s,
)

TIMEOUT_S = 0.5


class WedgedEngine(DelegatingEngine):
    """Accepts every request and never answers (a hung collective, a device stopped without an error)."""

    def __init__(self) -> None:
        super().__init__(FakeEngine())
        self.received: list[str] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.received.append(request.request_id)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class HeldEngine(FakeEngine):
    """Holds every request until `release` is set, then generates as FakeEngine does."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.release = asyncio.Event()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await self.release.wait()
        return await super().generate(request)


class CountingEngine(FakeEngine):
    """FakeEngine whose stats() reports the tokens it generated, as the native and vLLM engines do."""

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._running), generated_tokens=self.generated, version=self._version)


def within(coro, seconds: float):
    return asyncio.run(asyncio.wait_for(coro, seconds))


def test_wedged_replica_stops_the_run_naming_it_and_its_requests():
    # On-policy: 2 groups per version, so the Rollouter is paused on its budget while they hang.
    wedged = WedgedEngine()
    ro, q = make(6, n=2, required=2, trigger=1, threshold=0.0, engine_list=[wedged, FakeEngine(seed=1)],
                 progress_timeout_s=TIMEOUT_S)
    t0 = time.monotonic()
    with pytest.raises(EngineStalled) as info:
        within(ro.run(), 20)
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 5
    assert len(wedged.received) == 2 and not ro.budget.can_start()  # one response of each group, budget spent
    assert message.startswith("no token and no group for ")
    assert (f"while 2 request(s) were on the engines; the run stops (rollout.progress_timeout_s={TIMEOUT_S:g}: "
            f"raise it if the engines are slow rather than stuck): replica 0 holds 2 request(s), the oldest for ") in message
    assert message.endswith(f"its engine reports 0 tokens generated in all ({', '.join(wedged.received)})")
    assert "replica 1" not in message and "\n" not in message
    assert not ro._inflight  # the hung groups were cancelled


@pytest.mark.parametrize("reports_tokens", [True, False])
def test_slow_engine_that_produces_tokens_does_not_trip_it(reports_tokens):
    # Each response takes ~2 s (25 tokens, ~80 ms each), twice the timeout, with no request returning before it
    # ends: only the engine's token count shows the progress (without it, the watchdog trips).
    engine = (CountingEngine if reports_tokens else FakeEngine)(max_len=25, token_delay=0.08)
    ro, q = make(2, n=2, required=2, trigger=1, threshold=0.0, max_len=25, engine_list=[engine], progress_timeout_s=1.0)
    ro.sampling = replace(ro.sampling, ignore_eos=True)  # every response runs to max_tokens
    if reports_tokens:
        seen, _, _ = within(run_pipeline(ro, q, 2, 1, 2), 30)
        assert sorted(seen) == ["e0-i0", "e0-i1"] and ro.counters.generated_tokens == 4 * 25
    else:
        with pytest.raises(EngineStalled, match="replica 0 holds 4 request"):
            within(ro.run(), 30)


def test_a_sync_longer_than_the_timeout_does_not_trip_it():
    # partial_rollout=false: the sync waits for the requests in flight, here held for 4 timeouts.
    engine = HeldEngine()
    ro, q = make(2, n=2, required=2, trigger=1, threshold=0.0, partial=False, engine_list=[engine],
                 progress_timeout_s=TIMEOUT_S)

    async def go():
        run = asyncio.create_task(ro.run())
        while not any(ro.requests_on_engines()):
            await asyncio.sleep(0.005)
        pause = asyncio.create_task(ro.pause_for_sync())
        await asyncio.sleep(4 * TIMEOUT_S)
        assert not run.done() and ro.in_sync
        engine.release.set()
        await pause
        await ro.load_weights([("w", torch.ones(1))], 1)
        await ro.resume_after_sync(1)
        await run
        return await q.get_batch(2, timeout=5)

    assert len(within(go(), 20)) == 2


def test_a_budget_pause_longer_than_the_timeout_does_not_trip_it():
    ro, q = make(4, n=2, required=2, trigger=1, threshold=0.0, progress_timeout_s=TIMEOUT_S)
    ro.budget.started = ro.budget.limit  # nothing may start before the next sync

    async def go():
        run = asyncio.create_task(ro.run())
        await asyncio.sleep(4 * TIMEOUT_S)
        assert not run.done() and not any(ro.requests_on_engines())
        await ro.resume_after_sync(1)
        groups = await q.get_batch(2, timeout=5)
        await ro.resume_after_sync(2)
        await run
        return groups + await q.get_batch(2, timeout=5)

    assert len(within(go(), 20)) == 4


def test_stall_clock_by_hand():
    c = StallClock()
    assert c.observe(0.0, True, {"t": 0}) == 0.0  # first look: the clock starts
    assert c.observe(1.0, True, {"t": 0}) == 1.0
    assert c.observe(2.0, True, {"t": 5}) == 0.0  # progress
    assert c.observe(4.5, True, {"t": 5, "r0": 3}) == 0.0  # a new counter is progress too
    assert c.observe(6.0, True, {"t": 5, "r0": 2}) == 1.5  # a counter going down is not
    assert c.observe(9.0, False, {"t": 5}) == 0.0  # not watched (a sync, nothing in flight)
    assert c.observe(10.0, True, {"t": 5}) == 0.0  # watched again: a fresh start
    assert c.observe(12.0, True, {"t": 5}) == 2.0


def test_default_timeout_from_the_sizes():
    assert default_progress_timeout_s(64, 128, 64) == pytest.approx(600 + 64 * 192 / 1000)
    assert default_progress_timeout_s(256, 2048, 8192) == pytest.approx(3221.44)
    assert progress_timeout_s(None, 64, 128, 64) == default_progress_timeout_s(64, 128, 64)
    assert progress_timeout_s(30, 64, 128, 64) == 30.0
    with pytest.raises(ValueError, match="rollout.progress_timeout_s must be > 0"):
        ProgressWatchdog(make(1)[0], 0)


@pytest.mark.parametrize("extra,expected", [((), 600 + 64 * (64 + 12) / 1000), (("rollout.progress_timeout_s=7",), 7.0)])
def test_service_takes_the_timeout_from_the_config(tmp_path, tiny_model_dir, data_files, extra, expected):
    svc = _service(tmp_path, tiny_model_dir, data_files, [FakeEngine()], *extra)
    svc.reward.close()
    assert svc.rollouter.progress_timeout_s == pytest.approx(expected)
