"""The error of the collective layer (a module of its own so that every part of the layer,
the schedule check included, raises the same type; the schedule check's own error,
:class:`~mc_groups.CollectiveScheduleError`, is defined with it)."""

from __future__ import annotations

__all__ = ["CollectiveError"]


class CollectiveError(RuntimeError):
    """A collective failed or did not finish in time; the message names op and group."""
