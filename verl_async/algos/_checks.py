"""Input checks shared by the algos modules.

Every public function checks its tensors up front so a bad batch fails at the
call that received it, with the argument's name, instead of as a NaN three steps
later. The checks on device tensors cost one host sync each; that is cheap next to
a forward pass and far cheaper than a diverged run.
"""

from __future__ import annotations

from typing import Iterable

import torch


def check_tensor(name: str, x: object, *, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    return x


def check_same_shape(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, x in others.items():
        if x is None:
            continue
        check_tensor(name, x)
        if x.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}; they must match"
            )


def check_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """Return `mask` as bool; refuse values other than 0/1 (a weight is not a mask)."""
    check_tensor(name, mask)
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must hold only 0/1 values (or be bool)")
    return mask != 0


def check_finite(name: str, x: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Refuse NaN/inf in `x` (only at positions where `where` is True, when given)."""
    if not (x.is_floating_point() or x.is_complex()):
        return
    bad = ~torch.isfinite(x.detach())
    if where is not None:
        bad = bad & where
    if bool(bad.any()):
        count = int(bad.sum())
        scope = " at valid (masked-in) positions" if where is not None else ""
        raise ValueError(f"{name} holds {count} NaN/inf value(s){scope}")


def check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {list(choices)}")
    return value  # type: ignore[return-value]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over `mask` (bool); 0 when the mask is empty (never NaN)."""
    m = mask.to(x.dtype)
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / m.sum().clamp(min=1)
