"""pytest plugin of mc-groups (entry point ``mc_groups``): the session-wide ``rank_pools``
fixture.

A top-level module, not part of the ``mc_groups`` package, so that pytest can load it in
every environment where mc-groups is installed without importing ``mc_groups`` (and with
it torch) at start-up: the fixture imports the harness only when a test asks for it.
Load it explicitly with ``pytest -p mc_groups_pytest`` where plugin autoloading is off.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from mc_groups.testing import RankPools


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[RankPools]:
    """Rank-process pools shared by every test of the session, closed at its end."""
    from mc_groups.testing import RankPools  # noqa: PLC0415 (lazy: torch only when used)

    pools = RankPools()
    yield pools
    pools.close()
