"""The optional process default RNG tracker: the one permitted global of this package.

``model_parallel_cuda_manual_seed`` registers its tracker here (as Megatron sets its global
tracker); :mod:`mc_tp_layers.random` and :mod:`._recompute` read it when a caller passes no
tracker. Nothing requires it: explicit trackers always work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mc_tp_layers.random import RNGStatesTracker

__all__: list[str] = []


class _Slot:
    tracker: RNGStatesTracker | None = None


def default_tracker() -> RNGStatesTracker | None:
    """The registered tracker, or None."""
    return _Slot.tracker


def set_default_tracker(tracker: RNGStatesTracker | None) -> None:
    """Register ``tracker`` (None forgets it); the caller has checked its type."""
    _Slot.tracker = tracker
