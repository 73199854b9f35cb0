"""A weight bucket that crosses the Ray object store without being copied on either side.

Ray stores numpy arrays out of band (zero-copy into shared memory, read back as views) but
pickles torch tensors (one copy to serialise, one to deserialise). On this project's 2-core
machine a 256 MiB bf16 bucket took 0.47-0.53 s to put and 0.28-1.1 s to get as torch tensors,
0.04-0.13 s and 0.005 s as uint8 arrays. So the trainer packs each bucket's tensors as raw
bytes (`PackedBucket`) and the engine reads them back as tensor views of those bytes.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Iterable

import torch


class PackedBucket(Sequence):
    """(HF name, tensor) pairs stored as (name, dtype, shape, uint8 numpy array); indexing decodes a view."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.items = [
            (name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
             t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            for name, t in pairs
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[str, torch.Tensor]:  # type: ignore[override]
        name, dtype, shape, data = self.items[index]
        if data.size == 0:
            return name, torch.empty(shape, dtype=getattr(torch, dtype))
        with warnings.catch_warnings():  # object-store arrays are read-only; the tensor is only read (copied from)
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(data)
        return name, raw.view(getattr(torch, dtype)).reshape(shape)

    @property
    def nbytes(self) -> int:
        return sum(int(data.nbytes) for *_, data in self.items)
