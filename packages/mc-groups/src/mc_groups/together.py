"""Deprecated alias of :mod:`mc_groups.comm.peer_checks`, where issue 31 moved it with the
rest of the collective layer (:mod:`mc_groups.comm`). It re-exports that module's public
names for one release and will then be removed: import them from :mod:`mc_groups` or
:mod:`mc_groups.comm.peer_checks`."""

from __future__ import annotations

from mc_groups.comm.peer_checks import (
    CarriedStatus,
    PeerCheckError,
    fail_together,
)

__all__ = [
    "CarriedStatus",
    "PeerCheckError",
    "fail_together",
]
