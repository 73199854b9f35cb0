"""Replica decode-speed models: tokens/s PER SEQUENCE as a function of the batch size.

Continuous batching decodes one token for every running sequence per engine step,
so each sequence advances at 1 / step_latency(batch) tokens/s. The calibrated model
is :class:`StepLatencySpeed` (step latency c0 + c1 * batch: the weight-read floor
plus a per-sequence cost); :class:`TableSpeed` interpolates measured points and
:class:`ConstantSpeed` is the batch-independent model of the hand-checked tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class SpeedModel(Protocol):
    def tokens_per_s(self, batch: int) -> float:
        """Per-sequence decode speed with ``batch`` sequences running (batch >= 1)."""

    def to_dict(self) -> dict: ...


@dataclass(frozen=True)
class ConstantSpeed:
    tps: float

    def __post_init__(self) -> None:
        if not self.tps > 0:
            raise ValueError(f"ConstantSpeed: tps must be > 0, got {self.tps}")

    def tokens_per_s(self, batch: int) -> float:
        return self.tps

    def to_dict(self) -> dict:
        return {"model": "const", "tps": self.tps}


@dataclass(frozen=True)
class StepLatencySpeed:
    """tokens/s per sequence = 1 / (c0 + c1 * batch)."""

    c0: float
    c1: float

    def __post_init__(self) -> None:
        if not self.c0 > 0 or self.c1 < 0:
            raise ValueError(f"StepLatencySpeed needs c0 > 0 and c1 >= 0, got c0={self.c0} c1={self.c1}")

    def tokens_per_s(self, batch: int) -> float:
        return 1.0 / (self.c0 + self.c1 * batch)

    def to_dict(self) -> dict:
        return {"model": "latency", "c0": self.c0, "c1": self.c1}


@dataclass(frozen=True)
class TableSpeed:
    """Linear interpolation of measured (batch, tokens/s per sequence); flat beyond the ends."""

    batch: tuple[float, ...]
    tps: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.batch) == 0 or len(self.batch) != len(self.tps):
            raise ValueError("TableSpeed: batch and tps must be non-empty and of equal length")
        if any(b2 <= b1 for b1, b2 in zip(self.batch, self.batch[1:])):
            raise ValueError(f"TableSpeed: batch sizes must increase strictly, got {self.batch}")
        if any(not v > 0 for v in self.tps):
            raise ValueError(f"TableSpeed: every tps must be > 0, got {self.tps}")

    def tokens_per_s(self, batch: int) -> float:
        return float(np.interp(batch, self.batch, self.tps))

    def to_dict(self) -> dict:
        return {"model": "table", "batch": list(self.batch), "tps": list(self.tps)}


def speed_from_dict(d: dict) -> SpeedModel:
    kind = d.get("model")
    if kind == "const":
        return ConstantSpeed(float(d["tps"]))
    if kind == "latency":
        return StepLatencySpeed(float(d["c0"]), float(d["c1"]))
    if kind == "table":
        return TableSpeed(tuple(float(x) for x in d["batch"]), tuple(float(x) for x in d["tps"]))
    raise ValueError(f"speed model {kind!r} unknown (const | latency | table)")


def parse_speed(spec: str) -> SpeedModel:
    """CLI form: ``const:TPS`` | ``latency:C0,C1`` | ``table:B1=TPS1,B2=TPS2,...``."""
    kind, _, rest = spec.partition(":")
    try:
        if kind == "const":
            return ConstantSpeed(float(rest))
        if kind == "latency":
            c0, c1 = (float(x) for x in rest.split(","))
            return StepLatencySpeed(c0, c1)
        if kind == "table":
            pairs = [p.split("=") for p in rest.split(",")]
            return TableSpeed(tuple(float(b) for b, _ in pairs), tuple(float(v) for _, v in pairs))
    except ValueError as e:
        raise ValueError(f"--speed {spec!r}: {e}") from e
    raise ValueError(f"--speed {spec!r}: expected const:TPS, latency:C0,C1 or table:B=TPS,...")
