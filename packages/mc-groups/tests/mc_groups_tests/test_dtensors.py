"""``mc_groups.dtensors``' FSDP2 helpers on modules under ``fully_shard`` (2 gloo ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from mc_groups import dtensors
from mc_groups.testing import RankPools


def _fsdp_modules() -> dict[str, object]:
    torch.manual_seed(0)
    inner, plain, outer = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    model = torch.nn.Sequential(inner, plain, outer)
    world = dist.group.WORLD
    assert world is not None
    mesh = DeviceMesh.from_group(world, "cpu")
    fully_shard(inner, mesh=mesh)
    fully_shard(outer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        model(torch.ones(3, 4))  # the root keeps its unsharded params after a lone forward
    unsharded = not dtensors.is_dtensor(model[1].weight)
    return {
        "wrapped": [dtensors.is_fsdp_module(m) for m in (model, inner, plain, outer)],
        "others": [dtensors.is_fsdp_module(x) for x in (object(), None, torch.ones(1))],
        "root unsharded after forward": unsharded,
        "resharded": dtensors.reshard_fsdp(model),
        "sharded after": dtensors.is_dtensor(model[1].weight),
    }


def test_is_fsdp_module_and_reshard_fsdp(rank_pools: RankPools) -> None:
    """Exactly the modules ``fully_shard`` wrapped are FSDP modules; ``reshard_fsdp``
    counts them and leaves the root's params sharded again."""
    for out in rank_pools.get(2).run(_fsdp_modules):
        assert out == {
            "wrapped": [True, True, False, True],
            "others": [False, False, False],
            "root unsharded after forward": True,
            "resharded": 3,
            "sharded after": True,
        }
