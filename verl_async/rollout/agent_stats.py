"""Counters of multi-turn trajectories and their tool calls, as TensorBoard metrics (`multi_turn/*`).

Means and rates are over the trajectories and calls finished since the previous
`metrics()` call (the trainer asks once per step); `*_total` counts are over the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STOP_REASONS = ("no_call", "turn_limit", "length", "budget")  # why a trajectory ended


@dataclass
class TrajectoryRecord:
    assistant_turns: int
    tool_calls: int
    model_tokens: int
    inserted_tokens: int
    stop_reason: str


@dataclass
class _Window:
    trajectories: list[TrajectoryRecord] = field(default_factory=list)
    calls: int = 0
    successes: int = 0
    errors: int = 0
    timeouts: int = 0
    latencies: list[float] = field(default_factory=list)


class AgentStats:
    def __init__(self, prefix: str = "multi_turn") -> None:
        self.prefix = prefix
        self.window = _Window()
        self.totals = {"trajectories": 0, "tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "malformed_calls": 0,
                       "dropped_calls": 0}

    def record_call(self, status: str, success: bool, latency_s: float) -> None:
        w = self.window
        w.calls += 1
        w.successes += int(success)
        w.errors += int(status == "error")
        w.timeouts += int(status == "timeout")
        w.latencies.append(latency_s)
        self.totals["tool_calls"] += 1
        self.totals["tool_errors"] += int(status == "error")
        self.totals["tool_timeouts"] += int(status == "timeout")

    def record_parse(self, malformed: int, dropped: int) -> None:
        self.totals["malformed_calls"] += malformed
        self.totals["dropped_calls"] += dropped

    def record_trajectory(self, record: TrajectoryRecord) -> None:
        if record.stop_reason not in STOP_REASONS:
            raise ValueError(f"unknown stop reason {record.stop_reason!r}")
        self.window.trajectories.append(record)
        self.totals["trajectories"] += 1

    def metrics(self) -> dict[str, float]:
        p, w = self.prefix, self.window
        out = {f"{p}/{k}_total": float(v) for k, v in self.totals.items()}
        trajs = w.trajectories
        if trajs:
            n = len(trajs)
            model = sum(t.model_tokens for t in trajs)
            inserted = sum(t.inserted_tokens for t in trajs)
            out.update({
                f"{p}/turns/mean": sum(t.assistant_turns for t in trajs) / n,
                f"{p}/turns/max": float(max(t.assistant_turns for t in trajs)),
                f"{p}/tool_calls/mean": sum(t.tool_calls for t in trajs) / n,
                f"{p}/tool_call_rate": sum(t.tool_calls > 0 for t in trajs) / n,
                f"{p}/model_tokens/mean": model / n,
                f"{p}/tool_tokens/mean": inserted / n,
                f"{p}/masked_token_share": inserted / max(1, model + inserted),
            })
            for reason in STOP_REASONS:
                out[f"{p}/ended_by_{reason}"] = sum(t.stop_reason == reason for t in trajs) / n
        if w.calls:
            out.update({
                f"{p}/tool_success_rate": w.successes / w.calls,
                f"{p}/tool_error_rate": w.errors / w.calls,
                f"{p}/tool_timeout_rate": w.timeouts / w.calls,
                f"{p}/tool_latency_s/mean": sum(w.latencies) / w.calls,
                f"{p}/tool_latency_s/max": max(w.latencies),
            })
        self.window = _Window()
        return out
