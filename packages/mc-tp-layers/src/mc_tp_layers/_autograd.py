"""A typed ``Function.apply`` (torch's is untyped)."""

from __future__ import annotations

from typing import cast

import torch

__all__: list[str] = []


def apply(function: type[torch.autograd.Function], *args: object) -> torch.Tensor:
    """``function.apply(*args)`` for functions returning one tensor."""
    return cast(torch.Tensor, function.apply(*args))  # type: ignore[no-untyped-call]
