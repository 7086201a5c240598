"""Errors of the collective layer (a module of their own so that every part of the layer,
the schedule check included, raises the same types)."""

from __future__ import annotations

__all__ = ["CollectiveError", "CollectiveScheduleError"]


class CollectiveError(RuntimeError):
    """A collective failed or did not finish in time; the message names op and group."""


class CollectiveScheduleError(CollectiveError):
    """The ranks of a group were about to run different collectives (the opt-in schedule
    check found it before anything was issued); every rank of the group raises it."""
