"""pytest plugin (entry point ``mc_groups``): the session-wide ``rank_pools`` fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mc_groups.testing import RankPools


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[RankPools]:
    """Rank-process pools shared by every test of the session, closed at its end."""
    pools = RankPools()
    yield pools
    pools.close()
