"""A configurable delay per tool call: the slow-tool workload that asynchrony exists for (issue 23, item 9).

Every built-in tool reads `latency_s` from its YAML `config`: a number (fixed seconds) or
`[low, high]` (uniform per call, drawn from `latency_seed`). The delay is an asyncio
sleep: the engine and the other trajectories go on meanwhile, as with a remote sandbox.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, Mapping, Optional


class SimulatedLatency:
    def __init__(self, low: float = 0.0, high: Optional[float] = None, seed: Optional[int] = None) -> None:
        high = low if high is None else high
        if low < 0 or high < low:
            raise ValueError(f"latency_s: expected 0 <= low <= high, got [{low}, {high}]")
        self.low, self.high = float(low), float(high)
        self.rng = random.Random(seed)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "SimulatedLatency":
        value = config.get("latency_s", 0.0) or 0.0
        if isinstance(value, (int, float)):
            return cls(float(value), seed=config.get("latency_seed"))
        try:
            low, high = (float(v) for v in value)
        except (TypeError, ValueError):
            raise ValueError(f"latency_s: expected seconds or [low, high], got {value!r}") from None
        return cls(low, high, seed=config.get("latency_seed"))

    def draw(self) -> float:
        return self.low if self.high == self.low else self.rng.uniform(self.low, self.high)

    async def wait(self) -> float:
        """Sleep one drawn delay; returns it (0 when no latency is configured)."""
        delay = self.draw()
        if delay > 0:
            await asyncio.sleep(delay)
        return delay
