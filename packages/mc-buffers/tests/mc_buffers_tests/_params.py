"""Parameter factories shared by the tests (plain tensors, no model code needed)."""

from __future__ import annotations

import torch
from torch import nn


def linears(
    count: int, width: int = 95, *, bias: bool = False, seed: int = 0
) -> list[nn.Parameter]:
    """Params of ``count`` × ``nn.Linear(width, width)`` in registration order."""
    torch.manual_seed(seed)
    out: list[nn.Parameter] = []
    for _ in range(count):
        layer = nn.Linear(width, width, bias=bias)
        out.extend(layer.parameters())
    return out


def param(
    numel: int, *, dtype: torch.dtype = torch.float32, device: str = "cpu", **attrs: object
) -> nn.Parameter:
    """A 1-D param of ``numel`` elements (values 0..numel-1) with ``attrs`` set on it."""
    p = nn.Parameter(torch.arange(numel, dtype=torch.float32).to(dtype=dtype, device=device))
    for name, value in attrs.items():
        setattr(p, name, value)
    return p


def meta_param(numel: int, **attrs: object) -> nn.Parameter:
    """A storage-free param for layout-only tests."""
    p = nn.Parameter(torch.empty(numel, device="meta"))
    for name, value in attrs.items():
        setattr(p, name, value)
    return p
