"""Karmarkar-Karp, token-capped micro-batches, packing and unpacking."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_async.algos import (
    greedy_partition,
    karmarkar_karp,
    pack_sequences,
    partition_by_token_cap,
    spread,
    unpack_sequences,
)

SETTINGS = settings(max_examples=80, deadline=None)


def _flat(parts):
    return sorted(i for p in parts for i in p)


def test_kk_hand_case():
    lens = [4, 5, 6, 7, 8]  # LDM: 8-7, 6-5, 4-1, 3-1 -> spread 2; LPT greedy gets 4
    parts = karmarkar_karp(lens, 2)
    assert _flat(parts) == list(range(5)) and spread(lens, parts) == 2
    assert spread(lens, greedy_partition(lens, 2)) == 4
    parts = karmarkar_karp([1, 2, 3, 4, 5, 6], 3, equal_size=True)
    assert sorted(sum([1, 2, 3, 4, 5, 6][i] for i in p) for p in parts) == [7, 7, 7]
    assert all(len(p) == 2 for p in parts)


def test_zero_lengths_never_leave_a_part_empty():
    for k in (1, 2, 3):
        parts = karmarkar_karp([0, 0, 0], k)
        assert len(parts) == k and all(parts) and _flat(parts) == [0, 1, 2]
    parts = karmarkar_karp([0, 0, 5, 0], 3)
    assert all(parts) and spread([0, 0, 5, 0], parts) == 5


def test_token_cap_hand_case():
    lens = [5, 5, 4, 3, 3, 7, 8, 1]  # total 36, cap 10 -> at least 4 parts; 4 suffice
    parts = partition_by_token_cap(lens, 10)
    assert len(parts) == 4 and _flat(parts) == list(range(8))
    assert max(sum(lens[i] for i in p) for p in parts) <= 10
    assert len(partition_by_token_cap(lens, 10, min_parts=6)) == 6


def test_token_cap_errors_name_both_numbers():
    with pytest.raises(ValueError, match=r"sequence 1 has 9000 tokens.*max_tokens=8192"):
        partition_by_token_cap([10, 9000, 20], 8192)
    with pytest.raises(ValueError, match="min_parts"):
        partition_by_token_cap([1, 2], 10, min_parts=3)
    with pytest.raises(ValueError, match="seqlens"):
        partition_by_token_cap([1, -2], 10)


def test_kk_errors():
    with pytest.raises(ValueError, match="divisible"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)
    with pytest.raises(ValueError, match=r"k \(4\) exceeds"):
        karmarkar_karp([1, 2, 3], 4)
    with pytest.raises(ValueError, match="k must be"):
        karmarkar_karp([1, 2, 3], 0)


@SETTINGS
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40), st.data())
def test_kk_properties(lens, data):
    k = data.draw(st.integers(1, len(lens)))
    equal = data.draw(st.booleans()) and len(lens) % k == 0
    parts = karmarkar_karp(lens, k, equal_size=equal)
    assert len(parts) == k and all(parts) and _flat(parts) == list(range(len(lens)))
    assert spread(lens, parts) <= spread(lens, greedy_partition(lens, k, equal_size=equal))
    if equal:
        assert {len(p) for p in parts} == {len(lens) // k}


@SETTINGS
@given(st.lists(st.integers(0, 500), min_size=1, max_size=40), st.integers(500, 3000), st.integers(1, 4))
def test_token_cap_properties(lens, cap, min_parts):
    min_parts = min(min_parts, len(lens))
    parts = partition_by_token_cap(lens, cap, min_parts=min_parts)
    assert _flat(parts) == list(range(len(lens)))
    assert all(sum(lens[i] for i in p) <= cap for p in parts)
    assert len(parts) >= max(min_parts, math.ceil(sum(lens) / cap))
    # never more parts than first-fit-decreasing would use (or min_parts)
    ffd_bins: list[int] = []
    for n in sorted(lens, reverse=True):
        for b, used in enumerate(ffd_bins):
            if used + n <= cap:
                ffd_bins[b] += n
                break
        else:
            ffd_bins.append(n)
    assert len(parts) <= max(len(ffd_bins), min_parts)


def test_pack_hand_case():
    seqs = [torch.arange(n) for n in [3, 0, 5, 2, 7]]
    packs = pack_sequences(seqs, max_tokens=8)
    assert len(packs) == 3  # 17 tokens, cap 8: 3 packs
    for p in packs:
        assert p.num_tokens <= 8 and p.cu_seqlens.dtype == torch.int32 and int(p.cu_seqlens[0]) == 0
        for start, n in zip(p.cu_seqlens[:-1].tolist(), p.seqlens):
            assert p.position_ids[start : start + n].tolist() == list(range(n))
        assert p.max_seqlen == max(p.seqlens)
    small = next(p for p in packs if len(p.indices) == 3)
    assert small.indices == [0, 1, 3] and small.cu_seqlens.tolist() == [0, 3, 3, 5]
    assert small.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert small["input_ids"].tolist() == [0, 1, 2, 0, 1]


@SETTINGS
@given(st.lists(st.integers(0, 30), min_size=1, max_size=20), st.integers(30, 100), st.integers(0, 2**31 - 1))
def test_pack_unpack_identity(lens, cap, seed):
    g = torch.Generator().manual_seed(seed)
    data = {
        "input_ids": [torch.randint(0, 1000, (n,), generator=g) for n in lens],
        "values": [torch.randn(n, 2, generator=g) for n in lens],
    }
    packs = pack_sequences(data, cap)
    assert sorted(i for p in packs for i in p.indices) == list(range(len(lens)))
    for key in data:
        back = unpack_sequences([p[key] for p in packs], packs)
        assert len(back) == len(lens)
        for a, b in zip(back, data[key]):
            assert torch.equal(a, b)
    # a fixed number of packs instead of a cap
    k = min(3, len(lens))
    fixed = pack_sequences(data, num_packs=k)
    assert len(fixed) == k
    assert all(torch.equal(a, b) for a, b in zip(unpack_sequences([p["values"] for p in fixed], fixed), data["values"]))


def test_pack_bad_input():
    with pytest.raises(ValueError, match="exactly one"):
        pack_sequences([torch.zeros(3)])
    with pytest.raises(ValueError, match="same number"):
        pack_sequences({"a": [torch.zeros(3)], "b": []}, 10)
    with pytest.raises(ValueError, match="different lengths"):
        pack_sequences({"a": [torch.zeros(3)], "b": [torch.zeros(4)]}, 10)
    with pytest.raises(ValueError, match="max_tokens=4"):
        pack_sequences([torch.zeros(5)], 4)
    packs = pack_sequences([torch.zeros(3), torch.zeros(2)], 10)
    with pytest.raises(ValueError, match=r"values\[0\] must have 5 tokens"):
        unpack_sequences([torch.zeros(4)], packs)
