"""pytest plugin of mc-groups (entry point ``mc_groups``): the session-wide ``rank_pools``
fixture.

A top-level module, not part of the ``mc_groups`` package, so that pytest can load it in
every environment where mc-groups is installed without importing ``mc_groups`` (and with
it torch) at start-up: the fixture imports the harness only when a test asks for it.
Load it explicitly with ``pytest -p mc_groups_pytest`` where plugin autoloading is off.

The ini option ``mc_rank_pool_preload`` (module names) is the pools' ``preload``: what the
ranks of every pool would otherwise each import (``transformers`` costs seconds per rank),
imported once by the fork server, e.g. in ``pyproject.toml``::

    [tool.pytest.ini_options]
    mc_rank_pool_preload = ["transformers.models.llama.modeling_llama"]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from mc_groups.testing import RankPools


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "mc_rank_pool_preload",
        "modules the rank pools' fork server imports once before forking the ranks "
        "(RankPool(preload=)); a module that cannot be imported is skipped",
        type="linelist",
        default=[],
    )


def _preload(config: pytest.Config) -> list[str]:
    return list(config.getini("mc_rank_pool_preload"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """When a collected test uses ``rank_pools``: start the fork server now, so that its
    imports (torch and the preload) overlap the first tests instead of the first pool."""
    if any("rank_pools" in getattr(item, "fixturenames", ()) for item in session.items):
        from mc_groups.testing._pool import check_preload, start_fork_server  # noqa: PLC0415

        start_fork_server(check_preload(_preload(session.config)))


@pytest.fixture(scope="session")
def rank_pools(pytestconfig: pytest.Config) -> Iterator[RankPools]:
    """Rank-process pools shared by every test of the session, closed at its end."""
    from mc_groups.testing import RankPools  # noqa: PLC0415 (lazy: torch only when used)

    pools = RankPools(preload=_preload(pytestconfig))
    yield pools
    pools.close()
