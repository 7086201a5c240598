"""A typed ``Function.apply`` (torch's is untyped)."""

from __future__ import annotations

import torch

__all__: list[str] = []


def apply(function: type[torch.autograd.Function], *args: object) -> torch.Tensor:
    """``function.apply(*args)`` for functions returning one tensor."""
    out: torch.Tensor = function.apply(*args)  # type: ignore[no-untyped-call]  # (no cast() call per step)
    return out
