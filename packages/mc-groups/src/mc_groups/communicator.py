"""Deprecated alias of :mod:`mc_groups.comm.communicator`, where issue 31 moved it with the
rest of the collective layer (:mod:`mc_groups.comm`). It re-exports that module's public
names for one release and will then be removed: import them from :mod:`mc_groups` or
:mod:`mc_groups.comm.communicator`."""

from __future__ import annotations

from mc_groups.comm.communicator import (
    Communicator,
)

__all__ = [
    "Communicator",
]
