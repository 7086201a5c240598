"""torch-version shims of the collective layer: torch 2.13 renamed the flat-tensor
collectives (``*_single``); older releases only have the ``*_tensor`` names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__: list[str] = []


def _first_attr(*names: str) -> Callable[..., Any]:
    for name in names:
        found = getattr(dist, name, None)
        if found is not None:
            return found  # type: ignore[no-any-return]
    raise ImportError(f"torch.distributed has none of {names}")


reduce_scatter_flat = _first_attr("reduce_scatter_single", "reduce_scatter_tensor")
all_gather_flat = _first_attr("all_gather_single", "all_gather_into_tensor")
coalescing_manager: Callable[..., Any] = _first_attr("_coalescing_manager")
