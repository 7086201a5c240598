"""Deprecated alias of :mod:`mc_ddp.hooks`, where issue 31 moved ``param_ready.py`` (it held
every hook DDP leaves on a module, not only parameter readiness). It re-exports that
module's public names for one release and will then be removed: import them from
:mod:`mc_ddp` or :mod:`mc_ddp.hooks`. A package rather than a file of the old name, so
that git sees the move as a rename and carries edits made meanwhile to ``param_ready.py``
into ``hooks.py``."""

from mc_ddp.hooks import *  # noqa: F403
from mc_ddp.hooks import __all__ as __all__
