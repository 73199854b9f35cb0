"""P-DSR long-tail scheduling: the pure planning part (no Ray, no engine).

Per batch of prompts the Rollouter generates ONE probe response per prompt, then
calls :func:`plan_batch` with the probe lengths. The plan says which prompts go to
the heavy replica(s) (the top ``offload_ratio`` by probe length: their remaining
n-1 responses are expected to be long), and the ``max_tokens`` cap for the rest,
which run on fast replicas: ``fast_cap = ceil(cap_factor * L_cut)`` where ``L_cut``
is the probe length at the offload boundary. A fast response that stops at the cap
trips the breaker (:func:`trips_breaker`) and moves to a heavy replica, continuing
from its prefix (or restarting, which re-generates the prefix: the ``restart``
option that the measurements compare against).

Definitions (binding for the Rollouter, the simulator and the metrics):

* ranking: probe length descending; ties broken by batch position (earlier first),
  so a plan is a pure function of the probe lengths.
* offloaded count ``k = floor(offload_ratio * B + 0.5)`` (round half up), clamped to
  ``[0, B]``; ``offload_ratio = 0`` offloads nothing, ``1`` offloads every prompt.
* ``L_cut`` = the longest probe among the prompts that stay on the fast replicas,
  i.e. the probe at rank ``k`` (0-based). Every fast prompt's own probe is <= L_cut,
  so its cap is at least ``cap_factor`` times its own probe. ``None`` when k == B.
* ``fast_cap = max(1, ceil(cap_factor * L_cut))``, and at most ``max_response_length``
  (a cap at the maximum can never trip the breaker). This rank-based cap
  (``cap_mode="l_cut"``, the default) is the same for every fast prompt;
  ``cap_mode="probe"`` caps each fast prompt at ``cap_factor`` times its OWN probe
  (the notes' first variant, kept for comparison).
* breaker rate = moved responses / responses run under the cap on fast replicas
  (the n-1 non-probe responses of each fast prompt); breaker prompt rate = fast
  prompts with at least one moved response / fast prompts.
* top-k probe precision = |offloaded prompts that are truly in the batch's top k| / k,
  where "truly" ranks prompts by the mean (default) or max of all n response lengths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_EPS = 1e-9


@dataclass(frozen=True)
class BatchPlan:
    """Where each prompt of a batch goes. Positions index the batch as given."""

    order: tuple[int, ...]   # all positions, longest probe first
    heavy: tuple[int, ...]   # offloaded positions, in rank order
    fast: tuple[int, ...]    # positions kept on fast replicas, in rank order
    l_cut: int | None        # longest probe among fast prompts (None: no fast prompt)
    fast_cap: int | None     # the largest fast max_tokens (None: no fast prompt)
    caps: tuple[int | None, ...] = ()  # max_tokens per position; None for heavy prompts

    def is_heavy(self, position: int) -> bool:
        return self.caps[position] is None

    def cap_for(self, position: int) -> int | None:
        """max_tokens of the rest responses of ``position`` (None: heavy, no cap)."""
        return self.caps[position]


def num_offloaded(batch_size: int, offload_ratio: float) -> int:
    """How many prompts of a batch go heavy: round half up, clamped to [0, batch_size]."""
    _check_ratio(offload_ratio)
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    return max(0, min(batch_size, math.floor(offload_ratio * batch_size + 0.5 + _EPS)))


def rank_by_probe(probe_lengths: Sequence[int]) -> tuple[int, ...]:
    """Positions ordered longest probe first; ties keep batch order (deterministic)."""
    return tuple(sorted(range(len(probe_lengths)), key=lambda i: (-probe_lengths[i], i)))


def fast_cap(l_cut: int, cap_factor: float, max_response_length: int | None = None) -> int:
    """The fast replicas' max_tokens: ceil(cap_factor * L_cut), >= 1, <= max_response_length."""
    if not cap_factor > 0:
        raise ValueError(f"cap_factor must be > 0, got {cap_factor}")
    if l_cut < 0:
        raise ValueError(f"L_cut must be >= 0, got {l_cut}")
    cap = max(1, math.ceil(cap_factor * l_cut - _EPS))
    if max_response_length is not None:
        cap = min(cap, int(max_response_length))
    return cap


def plan_batch(
    probe_lengths: Sequence[int],
    offload_ratio: float = 0.2,
    cap_factor: float = 1.5,
    max_response_length: int | None = None,
    cap_mode: str = "l_cut",
) -> BatchPlan:
    """Rank a batch by probe length and split it into heavy and fast prompts."""
    if cap_mode not in ("l_cut", "probe"):
        raise ValueError(f"cap_mode must be 'l_cut' or 'probe', got {cap_mode!r}")
    lengths = [int(x) for x in probe_lengths]
    for i, x in enumerate(lengths):
        if x < 0:
            raise ValueError(f"probe_lengths[{i}] = {x}: lengths must be >= 0")
    order = rank_by_probe(lengths)
    k = num_offloaded(len(lengths), offload_ratio)
    heavy, fast = order[:k], order[k:]
    caps: list[int | None] = [None] * len(lengths)
    if not fast:
        return BatchPlan(order, heavy, fast, None, None, tuple(caps))
    l_cut = lengths[fast[0]]
    top_cap = fast_cap(l_cut, cap_factor, max_response_length)
    for i in fast:
        caps[i] = top_cap if cap_mode == "l_cut" else fast_cap(lengths[i], cap_factor, max_response_length)
    return BatchPlan(order, heavy, fast, l_cut, top_cap, tuple(caps))


def trips_breaker(finish_reason: str, generated: int, cap: int | None,
                  max_response_length: int) -> bool:
    """Did a fast response stop at the P-DSR cap (and not at the real maximum)?

    Only a length stop exactly at a cap below ``max_response_length`` means "not
    finished yet": a response that emitted EOS at the cap is done.
    """
    return (cap is not None and finish_reason == "length" and generated >= cap
            and cap < max_response_length)


def continuation_max_tokens(prefix_len: int, max_response_length: int) -> int:
    """max_tokens for a moved response that continues after ``prefix_len`` tokens."""
    if not 0 <= prefix_len <= max_response_length:
        raise ValueError(f"prefix_len {prefix_len} outside [0, max_response_length={max_response_length}]")
    return max_response_length - prefix_len


@dataclass(frozen=True)
class BreakerOutcome:
    """What the breaker does to one fast response whose final length is known (replay)."""

    moved: bool
    fast_tokens: int          # generated on the fast replica (== cap when moved)
    heavy_tokens: int         # generated on the heavy replica afterwards
    regenerated_tokens: int   # restart only: prefix tokens thrown away and generated again


def breaker_outcome(true_length: int, cap: int, restart: bool = False) -> BreakerOutcome:
    """Split a response of known length between the fast and the heavy replica."""
    if true_length <= cap:
        return BreakerOutcome(False, true_length, 0, 0)
    if restart:
        return BreakerOutcome(True, cap, true_length, cap)
    return BreakerOutcome(True, cap, true_length - cap, 0)


def true_group_length(lengths: Sequence[int], truth: str = "mean") -> float:
    """A prompt's real length: the mean (its expected length) or max (its tail)."""
    if truth == "mean":
        return sum(lengths) / len(lengths)
    if truth == "max":
        return float(max(lengths))
    raise ValueError(f"truth must be 'mean' or 'max', got {truth!r}")


def topk_precision(plan: BatchPlan, group_lengths: Sequence[Sequence[int]],
                   truth: str = "mean") -> tuple[int, int]:
    """(hits, k): offloaded prompts that are in the true top k of the batch.

    The true ranking uses :func:`true_group_length`, ties by batch position, so it
    is as deterministic as the probe ranking.
    """
    if len(group_lengths) != len(plan.order):
        raise ValueError(f"group_lengths has {len(group_lengths)} prompts, plan has {len(plan.order)}")
    k = len(plan.heavy)
    if k == 0:
        return 0, 0
    true_len = [true_group_length(g, truth) for g in group_lengths]
    true_top = set(sorted(range(len(true_len)), key=lambda i: (-true_len[i], i))[:k])
    return sum(1 for i in plan.heavy if i in true_top), k


@dataclass
class PDSRStats:
    """Running P-DSR counters; ``metrics()`` gives the logged names."""

    batches: int = 0
    prompts: int = 0
    offloaded: int = 0
    fast_responses: int = 0
    fast_prompts: int = 0
    breakers: int = 0
    breaker_prompts: int = 0
    regenerated_tokens: int = 0
    precision_hits: int = 0
    precision_k: int = 0

    def record_plan(self, plan: BatchPlan, n: int) -> None:
        """Count a planned batch; each fast prompt runs n-1 responses under the cap."""
        self.batches += 1
        self.prompts += len(plan.order)
        self.offloaded += len(plan.heavy)
        self.fast_responses += len(plan.fast) * max(0, n - 1)
        self.fast_prompts += len(plan.fast) if n > 1 else 0

    def record_precision(self, plan: BatchPlan, group_lengths: Sequence[Sequence[int]],
                         truth: str = "mean") -> None:
        hits, k = topk_precision(plan, group_lengths, truth)
        self.precision_hits += hits
        self.precision_k += k

    def record_breaker(self, regenerated_tokens: int = 0, first_in_group: bool = True) -> None:
        """One moved response; ``first_in_group``: its prompt had no breaker before."""
        self.breakers += 1
        self.breaker_prompts += bool(first_in_group)
        self.regenerated_tokens += int(regenerated_tokens)

    @property
    def breaker_rate(self) -> float:
        return self.breakers / self.fast_responses if self.fast_responses else 0.0

    @property
    def breaker_prompt_rate(self) -> float:
        return self.breaker_prompts / self.fast_prompts if self.fast_prompts else 0.0

    @property
    def offload_rate(self) -> float:
        return self.offloaded / self.prompts if self.prompts else 0.0

    @property
    def precision(self) -> float | None:
        return self.precision_hits / self.precision_k if self.precision_k else None

    def metrics(self) -> dict[str, float | int | None]:
        return {
            "pdsr/batches": self.batches,
            "pdsr/offload_count": self.offloaded,
            "pdsr/offload_rate": self.offload_rate,
            "pdsr/fast_responses": self.fast_responses,
            "pdsr/breaker_count": self.breakers,
            "pdsr/breaker_rate": self.breaker_rate,
            "pdsr/breaker_prompt_rate": self.breaker_prompt_rate,
            "pdsr/topk_precision": self.precision,
            "pdsr/regenerated_tokens": self.regenerated_tokens,
        }


def _check_ratio(offload_ratio: float) -> None:
    if not 0.0 <= offload_ratio <= 1.0:
        raise ValueError(f"offload_ratio must be in [0, 1], got {offload_ratio}")
