"""Deprecated alias of :mod:`mc_groups.comm.recorder`, where issue 31 moved it with the
rest of the collective layer (:mod:`mc_groups.comm`). It re-exports that module's public
names for one release and will then be removed: import them from :mod:`mc_groups` or
:mod:`mc_groups.comm.recorder`."""

from mc_groups.comm.recorder import *  # noqa: F403
from mc_groups.comm.recorder import __all__ as __all__  # noqa: PLC0414
