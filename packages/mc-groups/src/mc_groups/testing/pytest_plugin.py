"""The ``rank_pools`` fixture, for ``pytest -p mc_groups.testing.pytest_plugin``.

The entry point registered with pytest is the top-level :mod:`mc_groups_pytest`, which
defines the fixture without importing torch at start-up; this module re-exports it for
code that names the plugin by its old path.
"""

from __future__ import annotations

from mc_groups_pytest import rank_pools

__all__ = ["rank_pools"]
