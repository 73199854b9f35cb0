"""DAPO dynamic sampling under asynchrony (`algorithm.filter_groups.*`, verl's keys and meanings).

A group whose responses all have the same value of the filter metric carries zero GRPO
advantage: training on it costs a step and teaches nothing. The Rollouter asks
`GroupFilter.keep` after scoring, before the put: a dropped group never reaches the queue,
its staleness slot goes back to the budget (the Rollouter does that), and it is counted
(`fully_async/filtered_groups`, per data source) and listed in `rollout/filtered_groups.jsonl`.
Its prompt is consumed: it is not generated again, also not after a resume.

The metric of a response (verl's names):

* `seq_reward`: its reward as trained (score plus the DAPO overlong penalty);
* `seq_final_reward`: the same here; verl subtracts the in-reward KL first, which the Rollouter
  cannot compute (no reference model), so `algorithm.use_kl_in_reward=true` refuses it (config checks);
* any other name (`acc`, `score`, ...): that key of the scorer's reward info.

`max_num_gen_batches` bounds how long the run may go without a usable group: at most
`max_num_gen_batches * required_samples` groups in a row may be filtered (as many groups as
`max_num_gen_batches` of verl's generation batches hold); the next filtered one stops the run
with `FilterGroupsExhausted` instead of letting the trainer wait for a batch that never fills.
0: no bound (as in verl).
"""

from __future__ import annotations

import collections
import os
from typing import Any, Mapping, Optional, Sequence

from verl_async.protocol import Response, RolloutSample
from verl_async.rollout.lengths_log import append_jsonl

REWARD_METRICS = ("seq_reward", "seq_final_reward")  # the response's reward itself, not a reward-info key
FILTERED_LOG = "filtered_groups.jsonl"


class FilterGroupsExhausted(RuntimeError):
    """Too many groups in a row had zero spread (`algorithm.filter_groups.max_num_gen_batches`)."""


class MissingFilterMetric(KeyError):
    """The scorer's reward info has no value for the filter metric (`algorithm.filter_groups.metric`)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def metric_value(response: Response, metric: str) -> Optional[float]:
    """The response's value of `metric`; None when its scorer failed (a failed score carries no metric)."""
    if metric in REWARD_METRICS:
        return float(response.reward)
    if metric in response.reward_info:
        return float(response.reward_info[metric])
    if response.reward_info.get("reward_error"):
        return None
    raise MissingFilterMetric(
        f"algorithm.filter_groups.metric: {metric!r} is not in the reward info of a scored response (its keys: "
        f"{sorted(response.reward_info)}; or use seq_reward)"
    )


def has_zero_spread(values: Sequence[Optional[float]]) -> bool:
    """True when the group's metric values are all equal (verl: std == 0), so its GRPO advantage is 0.

    A group of one response is kept (verl does), and so is a group with a failed score (None): its
    value is unknown, not equal. Exact equality, not `np.std(values) == 0`, so three equal 0.1s
    count as equal (their float mean is not exactly 0.1).
    """
    if len(values) < 2 or any(v is None for v in values):
        return False
    return all(v == values[0] for v in values)


class GroupFilter:
    """The filter, its counters and its log."""

    def __init__(self, metric: str, *, max_num_gen_batches: int = 0, required_samples: int = 1,
                 log_path: Optional[str] = None) -> None:
        self.metric = metric
        self.max_num_gen_batches = max_num_gen_batches
        self.required_samples = required_samples
        # the most groups that may be filtered in a row (None: no bound)
        self.limit = max_num_gen_batches * required_samples if max_num_gen_batches > 0 else None
        self.log_path = log_path
        self.filtered = 0
        self.by_source: collections.Counter[str] = collections.Counter()
        self.in_a_row = 0  # filtered since the last kept group
        # The log must list exactly the groups the counters hold: a resume keeps its first `filtered` lines
        # (load_state_dict, before any group is generated); a fresh run starts it empty at its first line.
        self._log_started = False
        if log_path:
            os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)

    @classmethod
    def from_config(cls, filter_groups: Any, required_samples: int, run_dir: str) -> Optional["GroupFilter"]:
        """None when `algorithm.filter_groups.enable` is off (or the section is absent)."""
        if filter_groups is None or not bool(filter_groups.get("enable", False)):
            return None
        return cls(str(filter_groups.metric), max_num_gen_batches=int(filter_groups.get("max_num_gen_batches") or 0),
                   required_samples=required_samples, log_path=os.path.join(run_dir, "rollout", FILTERED_LOG))

    def keep(self, sample: RolloutSample, version: int) -> bool:
        """Whether `sample` goes to the queue; a dropped one is counted and logged (raises past the bound)."""
        values = [metric_value(r, self.metric) for r in sample.responses]
        if not has_zero_spread(values):
            self.in_a_row = 0
            return True
        self.filtered += 1
        self.by_source[sample.data_source] += 1
        self.in_a_row += 1
        if self.log_path:
            if not self._log_started:
                open(self.log_path, "w").close()
                self._log_started = True
            append_jsonl(self.log_path, {"uid": sample.uid, "index": sample.index, "epoch": sample.epoch,
                                         "data_source": sample.data_source, "metric": self.metric,
                                         "value": values[0], "version": version})
        if self.limit is not None and self.in_a_row > self.limit:
            raise FilterGroupsExhausted(
                f"algorithm.filter_groups.max_num_gen_batches: {self.in_a_row} groups in a row had the same "
                f"{self.metric!r} for every response (last value {values[0]}, data_source {sample.data_source!r}); "
                f"at most max_num_gen_batches x required_samples = {self.max_num_gen_batches} x "
                f"{self.required_samples} = {self.limit} may be filtered in a row. The data may be too hard (or too "
                f"easy) for the model: check the rewards, raise max_num_gen_batches, or set it to 0 for no bound"
            )
        return False

    def metrics(self) -> dict[str, float]:
        out = {"fully_async/filtered_groups": float(self.filtered),
               "fully_async/filtered_groups_in_a_row": float(self.in_a_row)}
        out.update({f"fully_async/filtered_groups/{source or 'unknown'}": float(count)
                    for source, count in sorted(self.by_source.items())})
        return out

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        return {"filtered": self.filtered, "by_source": dict(self.by_source), "in_a_row": self.in_a_row}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Counters of the checkpoint; the log keeps its first `filtered` lines (later ones were lost with the
        crash: those prompts were pending at the checkpoint and are generated again)."""
        self.filtered = int(state.get("filtered", 0))
        self.by_source = collections.Counter({str(k): int(v) for k, v in dict(state.get("by_source", {})).items()})
        self.in_a_row = int(state.get("in_a_row", 0))
        if self.log_path:
            lines: list[str] = []
            if os.path.exists(self.log_path):
                with open(self.log_path) as f:
                    lines = [line for line in f if line.strip()][: self.filtered]
            with open(self.log_path, "w") as f:
                f.writelines(lines)
            self._log_started = True
