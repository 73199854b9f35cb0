"""Sequence-length balancing: Karmarkar-Karp partitions and token-capped micro-batches.

Used to split a batch over DP ranks with equal token loads (`karmarkar_karp(...,
k=dp_size, equal_size=True)`) and to cut a rank's share into the fewest
micro-batches under `ppo_max_token_len_per_gpu` with balanced sums
(`partition_by_token_cap`, what `use_dynamic_bsz` needs). All return lists of
index lists, each sorted ascending.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Sequence


def _check_seqlens(seqlens: Sequence[int]) -> list[int]:
    out = []
    for i, n in enumerate(seqlens):
        v = int(n)
        if v != n or v < 0:
            raise ValueError(f"seqlens[{i}] must be a non-negative integer, got {n!r}")
        out.append(v)
    return out


def _check_k(k: int, n: int, equal_size: bool) -> None:
    if int(k) != k or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if k > n:
        raise ValueError(f"k ({k}) exceeds the number of sequences ({n}); every part must get at least one")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs the number of sequences ({n}) to be divisible by k ({k})")


def spread(seqlens: Sequence[int], parts: Sequence[Sequence[int]]) -> int:
    """Largest part sum minus smallest part sum."""
    sums = [sum(seqlens[i] for i in p) for p in parts]
    return max(sums) - min(sums)


def _finish(parts: list[list[int]]) -> list[list[int]]:
    return [sorted(p) for p in parts]


def greedy_partition(seqlens: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Longest-processing-time greedy: longest first, each to the lightest part (that
    still has room when `equal_size`)."""
    lens = _check_seqlens(seqlens)
    _check_k(k, len(lens), equal_size)
    cap = len(lens) // k if equal_size else len(lens)
    parts: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for i in sorted(range(len(lens)), key=lambda j: (-lens[j], j)):
        j = min((p for p in range(k) if len(parts[p]) < cap), key=lambda p: (sums[p], len(parts[p]), p))
        parts[j].append(i)
        sums[j] += lens[i]
    return _finish(parts)


def _kk(lens: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """Largest differencing method. A state is k (sum, indices) sets sorted by sum,
    descending; repeatedly merge the two states with the largest spread, pairing the
    heaviest set of one with the lightest of the other."""
    order = sorted(range(len(lens)), key=lambda j: (lens[j], j))
    tie = itertools.count()
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []

    def push(sets: list[tuple[int, list[int]]]) -> None:
        sets.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), next(tie), sets))

    if equal_size:  # seed states of k items each, so every merge keeps part sizes equal
        for off in range(0, len(order), k):
            push([(lens[j], [j]) for j in order[off : off + k]])
    else:
        for j in order:
            push([(lens[j], [j])] + [(0, []) for _ in range(k - 1)])
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        push([(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)])
    return [idx for _, idx in heap[0][2]]


def _fill_empty(parts: list[list[int]], lens: list[int]) -> list[list[int]]:
    """Give every empty part one item (LDM can leave a part empty when lengths are 0):
    a zero-length item if any part of 2+ items has one, else the smallest item of the
    heaviest such part."""
    for empty in [p for p in parts if not p]:
        donors = [p for p in parts if len(p) > 1]
        zero = [(p, i) for p in donors for i in p if lens[i] == 0]
        if zero:
            donor, item = zero[0]
        else:
            donor = max(donors, key=lambda p: sum(lens[i] for i in p))
            item = min(donor, key=lambda i: lens[i])
        donor.remove(item)
        empty.append(item)
    return parts


def karmarkar_karp(seqlens: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Partition indices `0..n-1` into `k` parts with balanced sums of `seqlens`.

    Largest differencing (Karmarkar-Karp), as verl's seqlen_balancing; `equal_size`
    gives every part `n/k` indices (n must divide). LDM is usually better than the
    greedy LPT rule but not always, so the greedy result is computed too and the
    one with the smaller spread is returned (never worse than greedy). Every part is
    non-empty; `k > n` is an error.
    """
    lens = _check_seqlens(seqlens)
    _check_k(k, len(lens), equal_size)
    kk = _finish(_fill_empty(_kk(lens, k, equal_size), lens))
    greedy = greedy_partition(lens, k, equal_size)
    return greedy if spread(lens, greedy) < spread(lens, kk) else kk


def _first_fit_decreasing(lens: list[int], cap: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lens)), key=lambda j: (-lens[j], j)):
        for b, r in enumerate(room):
            if lens[i] <= r:
                bins[b].append(i)
                room[b] -= lens[i]
                break
        else:
            bins.append([i])
            room.append(cap - lens[i])
    return _finish(bins)


def partition_by_token_cap(seqlens: Sequence[int], max_tokens: int, *, min_parts: int = 1) -> list[list[int]]:
    """The fewest parts (micro-batches) whose token sums stay <= `max_tokens`, balanced.

    Tries k = max(min_parts, ceil(total / max_tokens)) upward with Karmarkar-Karp and
    returns the first partition that fits the cap; first-fit-decreasing bounds the
    search (its part count always fits, and is used when KK cannot fit in fewer).
    `min_parts` lets DP ranks agree on one count (all-reduce MAX of each rank's count,
    then call again). A sequence longer than the cap is an error naming both numbers.
    """
    lens = _check_seqlens(seqlens)
    if int(max_tokens) != max_tokens or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if not lens:
        raise ValueError("seqlens is empty: nothing to partition")
    too_long = [(i, n) for i, n in enumerate(lens) if n > max_tokens]
    if too_long:
        i, n = max(too_long, key=lambda t: t[1])
        raise ValueError(
            f"sequence {i} has {n} tokens, more than max_tokens={max_tokens} (ppo_max_token_len_per_gpu); "
            f"raise the cap to at least {n} or shorten the sequences"
        )
    if int(min_parts) != min_parts or not 1 <= min_parts <= len(lens):
        raise ValueError(f"min_parts must be in [1, {len(lens)}] (the number of sequences), got {min_parts!r}")
    ffd = _first_fit_decreasing(lens, max_tokens)
    k = max(min_parts, math.ceil(sum(lens) / max_tokens))
    while True:  # k <= len(lens) throughout, since every sequence fits the cap
        parts = karmarkar_karp(lens, k)
        if max(sum(lens[i] for i in p) for p in parts) <= max_tokens:
            return parts
        if k >= len(ffd):
            return _split_to(ffd, k, lens)
        k += 1


def _split_to(parts: list[list[int]], k: int, lens: list[int]) -> list[list[int]]:
    """Split the most populated parts in two (greedy halves) until there are k; sums only drop."""
    parts = [list(p) for p in parts]
    while len(parts) < k:
        big = max(range(len(parts)), key=lambda j: len(parts[j]))
        items = parts.pop(big)
        parts.extend(greedy_partition([lens[i] for i in items], 2))
        parts[-2:] = [[items[i] for i in half] for half in parts[-2:]]
    return _finish(parts)
