"""verl_async/sync/buckets.py PackedBucket: a packed bucket decodes to the same tensors, crosses Ray, and engines accept it."""

from __future__ import annotations

import pickle

import pytest
import torch

from verl_async.rollout.native.weights import _as_bucket
from verl_async.sync.buckets import PackedBucket

PAIRS = [
    ("bf16", torch.randn(3, 5).to(torch.bfloat16)),
    ("f32", torch.randn(7)),
    ("scalar", torch.tensor(2.5)),
    ("ints", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
    ("mask", torch.tensor([True, False, True])),
    ("strided", torch.randn(4, 6).t()),  # not contiguous: packed contiguous
    ("empty", torch.zeros(0, 3)),
]


def _same(a, b) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def test_round_trip_keeps_names_dtypes_shapes_and_bytes():
    bucket = PackedBucket(PAIRS)
    assert len(bucket) == len(PAIRS) and _same(list(bucket), PAIRS)
    assert bucket.nbytes == sum(t.numel() * t.element_size() for _, t in PAIRS)
    assert _same(pickle.loads(pickle.dumps(bucket)), PAIRS)
    assert _same(_as_bucket(bucket, 0), PAIRS)  # what the native and vLLM engines load from


def test_through_the_object_store(ray_session):
    import ray

    @ray.remote
    def names_and_sums(b):
        return [(n, float(t.float().sum())) for n, t in b]

    got = ray.get(names_and_sums.remote(ray.put(PackedBucket(PAIRS))), timeout=60)
    # the packed tensors are contiguous: sum the reference in that memory order too (a strided sum adds in
    # another order, and a sum near 0 of random values then differs by more than approx's relative 1e-6)
    assert got == [(n, pytest.approx(float(t.contiguous().float().sum()))) for n, t in PAIRS]
