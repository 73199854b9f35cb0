"""In-place weight refit from a stream of HF-named tensors.

The stream yields either single `(name, tensor)` pairs or buckets (a list of pairs or a
dict name -> tensor). Each item is validated as a whole before any of its tensors is
copied, so a bad item changes nothing; tensors are copied into the live parameters'
storage (`param.copy_`), so the extra memory is what the producer holds (one bucket), and
captured CUDA graphs stay valid. Tied weights (e.g. `lm_head.weight` aliasing
`model.embed_tokens.weight`) resolve to the same parameter and are written once.

A bad item in the middle of a stream leaves the items before it applied: the error says
how many tensors were loaded and that the model now mixes old and new weights until a
complete update succeeds (the caller should resend; the engine does not bump the version).
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch


class WeightUpdateError(ValueError):
    """A weight stream item could not be applied; nothing of that item was copied."""


def _as_bucket(item: Any, index: int) -> list[tuple[str, Any]]:
    if isinstance(item, Mapping):
        return list(item.items())
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
        return [item]
    if isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
        pairs = list(item)  # a list of pairs, or a PackedBucket (verl_async/sync/buckets.py): decoded once
        if all(isinstance(x, tuple) and len(x) == 2 for x in pairs):
            return pairs
    raise WeightUpdateError(
        f"update_weights: item {index} of the weight stream is a {type(item).__name__}; expected a "
        "(name, tensor) pair, a list of pairs or a dict name -> tensor"
    )


class WeightLoader:
    def __init__(self, model: torch.nn.Module, *, check_finite: bool = True) -> None:
        self.targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        self.parameter_names = [name for name, _ in model.named_parameters()]  # one name per tensor (tied: the first)
        for name, buf in model.named_buffers(remove_duplicate=False):
            self.targets.setdefault(name, buf)
        self.check_finite = check_finite
        self._written_version: Optional[int] = None
        self._written: set[int] = set()  # ids of the tensors written under `_written_version`

    def _check(self, name: Any, tensor: Any, loaded: int) -> torch.Tensor:
        """The model tensor `name` loads into; raises WeightUpdateError naming it and the reason."""

        def fail(reason: str) -> WeightUpdateError:
            if loaded:
                state = (
                    f"; {loaded} tensor(s) of this update were already loaded, so the model mixes old and new "
                    "weights until a complete update succeeds"
                )
            else:
                state = "; nothing of this update was loaded"
            return WeightUpdateError(f"update_weights: tensor {name!r}: {reason}{state}")

        if not isinstance(name, str):
            raise fail("the name must be a string")
        target = self.targets.get(name)
        if target is None:
            close = difflib.get_close_matches(name, self.targets.keys(), n=3)
            raise fail("unknown weight name" + (f" (did you mean {close}?)" if close else ""))
        if not isinstance(tensor, torch.Tensor):
            raise fail(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise fail(f"shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}")
        if target.is_floating_point() != tensor.is_floating_point():
            raise fail(f"dtype {tensor.dtype} cannot be loaded into a {target.dtype} tensor")
        if self.check_finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise fail("contains NaN or Inf")
        return target

    def load(self, stream: Iterable[Any], version: Optional[int] = None) -> int:
        """Copy every tensor of `stream` into the model; return how many tensors were loaded.

        Loads under one `version` add up (a sync may arrive in several calls, one per bucket):
        `unwritten(version)` then names the parameters none of them wrote.
        """
        if version is None or version != self._written_version:
            self._written_version, self._written = version, set()
        loaded = 0
        with torch.no_grad():
            for index, item in enumerate(stream):
                bucket = _as_bucket(item, index)
                targets = [self._check(name, tensor, loaded) for name, tensor in bucket]
                written: set[int] = set()
                for (_, tensor), target in zip(bucket, targets):
                    if id(target) not in written:  # a tied alias sent twice in one bucket is written once
                        target.copy_(tensor)
                        written.add(id(target))
                    loaded += 1
                self._written |= written
        return loaded

    def unwritten(self, version: int) -> list[str]:
        """Parameters that no load under `version` wrote: after a full weight sync, a name-mapping gap that would
        leave them at their old (or initial) values without any error."""
        done = self._written if version == self._written_version else set()
        return [name for name in self.parameter_names if id(self.targets[name]) not in done]
