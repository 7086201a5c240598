"""The optional process default RNG tracker (the one permitted global of this package), and
what a tracker is to the code that reads the default.

``model_parallel_cuda_manual_seed`` registers its tracker here (as Megatron sets its global
tracker); :mod:`mc_tp_layers.random` and :mod:`._recompute` read it when a caller passes no
tracker. Nothing requires it: explicit trackers always work. The slot is typed by the
:class:`StatesTracker` protocol, not by :class:`~mc_tp_layers.RNGStatesTracker`, so this
module imports neither of its readers (no import cycle, not even for types).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__: list[str] = []


@runtime_checkable
class StatesTracker(Protocol):
    """What the recompute needs of an RNG tracker (mc's or Megatron's)."""

    def get_states(self) -> Any:
        """Every stream's state."""

    def set_states(self, states: Any) -> None:
        """Replace every stream's state."""


class _Slot:
    tracker: StatesTracker | None = None


def default_tracker() -> StatesTracker | None:
    """The registered tracker, or None."""
    return _Slot.tracker


def set_default_tracker(tracker: StatesTracker | None) -> None:
    """Register ``tracker`` (None forgets it); the caller has checked its type."""
    _Slot.tracker = tracker
