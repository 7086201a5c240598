"""Domain checks of :class:`~mc_ddp.DistributedDataParallelConfig` (types come from
:mod:`mc_groups.argcheck`): each error names the field, the value and the fix."""

from __future__ import annotations


def need(condition: bool, message: str) -> None:
    """``ValueError(message)`` unless ``condition``."""
    if not condition:
        raise ValueError(message)
