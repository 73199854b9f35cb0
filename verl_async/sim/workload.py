"""Workloads the simulator replays: per-group response lengths, from a log or synthetic.

A :class:`GroupSpec` is one prompt with its n final response lengths (a moved
response's length is its whole length) and which response is the probe. Replay
keeps the log's submission order. The synthetic generator draws per-prompt mean
lengths log-normally and per-response lengths log-normally around that mean with
a per-prompt CV, capped at ``max_response_length``; :func:`length_stats` measures a
workload the same way the reference notes measured real logs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verl_async.rollout import pdsr
from verl_async.sim.runlog import read_lengths


@dataclass(frozen=True)
class GroupSpec:
    uid: str
    prompt_len: int
    lengths: tuple[int, ...]
    probe: int = 0      # index into lengths of the probe response (P-DSR)

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError(f"group {self.uid!r}: no responses")
        if not 0 <= self.probe < len(self.lengths):
            raise ValueError(f"group {self.uid!r}: probe index {self.probe} outside its {len(self.lengths)} responses")
        if self.prompt_len < 0 or min(self.lengths) < 0:
            raise ValueError(f"group {self.uid!r}: negative prompt_len or response length")

    @property
    def probe_len(self) -> int:
        return self.lengths[self.probe]

    @property
    def rest(self) -> tuple[int, ...]:
        return self.lengths[:self.probe] + self.lengths[self.probe + 1:]


def groups_from_log(path: str | Path) -> list[GroupSpec]:
    """Replay order = submission order (submit_time, then index). The probe is the
    response flagged ``probe``, else the first response."""
    recs = sorted(read_lengths(path), key=lambda g: (g["submit_time"], g["index"]))
    out = []
    for g in recs:
        flags = [j for j, r in enumerate(g["responses"]) if r["probe"]]
        out.append(GroupSpec(g["uid"], g["prompt_len"], tuple(r["len"] for r in g["responses"]),
                             flags[0] if flags else 0))
    return out


@dataclass(frozen=True)
class SyntheticSpec:
    """Knobs of the synthetic long-tail generator (defaults: the "reference" preset)."""

    median_len: float = 500.0        # median of per-prompt mean lengths
    prompt_sigma: float = 0.35       # log-normal sigma of per-prompt means (between-prompt spread)
    cv_mean: float = 0.34            # mean per-prompt CV of the length distribution (the
                                     # measured sample CV of n=8 comes out lower, ~0.29)
    cv_sigma: float = 0.5            # log-normal sigma of the per-prompt CV
    max_response_length: int = 4096
    prompt_len_min: int = 64
    prompt_len_max: int = 256


PRESETS: dict[str, SyntheticSpec] = {
    # tuned so length_stats roughly matches the measured 0.5B/MATH statistics
    "reference": SyntheticSpec(),
    # a heavier tail: wider between-prompt spread, longer responses, tighter max
    "longtail": SyntheticSpec(median_len=600.0, prompt_sigma=0.9, cv_mean=0.30,
                              max_response_length=4096),
}


def synthetic_groups(num_groups: int, n: int, spec: SyntheticSpec | str = "reference",
                     seed: int = 0) -> list[GroupSpec]:
    """Deterministic (seeded) synthetic workload; the probe is response 0."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"synthetic preset {spec!r} unknown: {sorted(PRESETS)}")
        spec = PRESETS[spec]
    if num_groups < 1 or n < 1:
        raise ValueError(f"num_groups and n must be >= 1, got {num_groups}, {n}")
    rng = np.random.default_rng(seed)
    means = spec.median_len * np.exp(spec.prompt_sigma * rng.standard_normal(num_groups))
    cvs = spec.cv_mean * np.exp(spec.cv_sigma * rng.standard_normal(num_groups) - spec.cv_sigma ** 2 / 2)
    s2 = np.log1p(cvs ** 2)                      # log-normal with mean m and CV cv
    mu = np.log(means) - s2 / 2
    raw = np.exp(mu[:, None] + np.sqrt(s2)[:, None] * rng.standard_normal((num_groups, n)))
    lengths = np.clip(np.rint(raw), 1, spec.max_response_length).astype(int)
    prompt_lens = rng.integers(spec.prompt_len_min, spec.prompt_len_max + 1, num_groups)
    return [GroupSpec(f"syn-{i}", int(prompt_lens[i]), tuple(int(x) for x in lengths[i]))
            for i in range(num_groups)]


def length_stats(groups: Sequence[GroupSpec], batch_size: int, offload_ratio: float = 0.2,
                 cap_factor: float = 1.5, threshold: int = 512,
                 max_response_length: int | None = None, cap_mode: str = "l_cut") -> dict:
    """The reference notes' statistics on a workload (static replay, no timing).

    * cv_mean / cv_max: per-prompt CV (population std / mean) of its n lengths;
    * probe_fn_rate: among prompts whose probe < threshold, the share with some
      other response > threshold (the notes' "63%");
    * topk_precision_mean / _max: P-DSR top-k precision with truth = group mean / max;
    * breaker_rate: moved / fast rest responses under the P-DSR cap (``cap_mode``);
      breaker_prompt_rate: fast prompts with at least one moved response.
    Batches are consecutive ``batch_size`` groups (the last may be smaller).
    """
    lens = [np.asarray(g.lengths, dtype=float) for g in groups]
    cvs = np.array([x.std() / x.mean() if x.mean() > 0 else 0.0 for x in lens])
    short = [g for g in groups if g.probe_len < threshold]
    fn = sum(1 for g in short if any(x > threshold for x in g.rest))
    stats = {"mean": pdsr.PDSRStats(), "max": pdsr.PDSRStats()}
    for b in range(0, len(groups), batch_size):
        batch = groups[b:b + batch_size]
        plan = pdsr.plan_batch([g.probe_len for g in batch], offload_ratio, cap_factor,
                               max_response_length, cap_mode)
        for truth, st in stats.items():
            st.record_precision(plan, [g.lengths for g in batch], truth)
        st = stats["mean"]
        st.record_plan(plan, len(batch[0].lengths))
        for pos in plan.fast:
            moved = [x for x in batch[pos].rest if pdsr.breaker_outcome(x, plan.cap_for(pos)).moved]
            for j in range(len(moved)):
                st.record_breaker(first_in_group=j == 0)
    all_lens = np.concatenate(lens)
    return {
        "groups": len(groups),
        "responses": int(all_lens.size),
        "len_mean": float(all_lens.mean()),
        "len_p50": float(np.percentile(all_lens, 50)),
        "len_p99": float(np.percentile(all_lens, 99)),
        "len_max": int(all_lens.max()),
        "cv_mean": float(cvs.mean()),
        "cv_max": float(cvs.max()),
        "probe_fn_threshold": threshold,
        "probe_fn_rate": fn / len(short) if short else math.nan,
        "topk_precision_mean": stats["mean"].precision,
        "topk_precision_max": stats["max"].precision,
        "breaker_rate": stats["mean"].breaker_rate,
        "breaker_prompt_rate": stats["mean"].breaker_prompt_rate,
        "batch_size": batch_size,
        "offload_ratio": offload_ratio,
        "cap_factor": cap_factor,
        "cap_mode": cap_mode,
    }
