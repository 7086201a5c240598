"""ProcessGroupCollection: names, types, repr (repr and real groups need a world)."""

from __future__ import annotations

import torch.distributed as dist

from mc_groups import ProcessGroupCollection
from mc_groups.collection import GROUP_FIELDS
from mc_groups.testing import RankPools


def test_unset_fields_read_none() -> None:
    pgc = ProcessGroupCollection()
    for name in GROUP_FIELDS:
        assert getattr(pgc, name) is None
    assert repr(pgc) == "ProcessGroupCollection(empty)"
    assert "tp" not in pgc
    assert list(pgc.items()) == []


def _repr_with_groups() -> tuple[str, bool, int]:
    world = dist.group.WORLD
    assert world is not None
    me = dist.new_group([dist.get_rank()])
    pgc = ProcessGroupCollection(tp=world, pp=me)
    found = pgc.require("tp", "test") is world
    return repr(pgc), found, len(list(pgc.items()))


def test_repr_lists_sizes(rank_pools: RankPools) -> None:
    results = rank_pools.get(2).run(_repr_with_groups)
    assert results == [("ProcessGroupCollection(tp(2), pp(1))", True, 2)] * 2
