"""Conformance with Megatron-LM's
``tests/unit_tests/distributed/test_distributed_data_parallel.py``: the same facts held
against mc-ddp on 2 gloo ranks.

Upstream wraps two identical models, one with the default process groups and one with a
hand-built ``ProcessGroupCollection`` holding only dp, dp_cp, pp, tp and ep, and checks that
both wraps compute the same outputs and ``main_grad`` bit for bit. The same is done here (the
default being mc's registered default collection, the hand-built groups coming straight from
``torch.distributed.new_group``), and the reduced grads are also compared with a
single-process reference (fp32, |Δ| ≤ 1e-6: summation order only, as in the parity matrix).
"""

from __future__ import annotations

import copy
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
from mc_buffers import BufferKey
from mc_ddp import DistributedDataParallel
from mc_ddp_tests._harness import ddp_config
from mc_groups.collection import clear_default_collection
from mc_groups.testing import RankPools

IN, OUT, BATCH = 13, 17, 2
TIMEOUT = timedelta(seconds=30)


class _TwoLayer(nn.Module):
    """Upstream's test model: Linear(13, 52) → ReLU → Linear(52, 17)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # same weights on every rank, so the reference can be local
        self.linear1 = nn.Linear(IN, IN * 4)
        self.activation = nn.ReLU()
        self.linear2 = nn.Linear(IN * 4, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear2(self.activation(self.linear1(x)))
        return out


def _batch(rank: int) -> torch.Tensor:
    """Rank ``rank``'s integer-valued input, as upstream draws it."""
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randint(0, 10, (BATCH, IN), generator=gen).float()


def _new_groups(world: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup, list[Any]]:
    """Two 2-rank groups (dp, dp_cp) and this rank's one-rank pp, tp and ep groups, made
    directly with torch.distributed (every rank takes part in every creation)."""
    dp = dist.new_group(list(range(world)), timeout=TIMEOUT)
    dp_cp = dist.new_group(list(range(world)), timeout=TIMEOUT)
    singles = [[dist.new_group([r], timeout=TIMEOUT) for r in range(world)] for _ in range(3)]
    return dp, dp_cp, singles


class _OtherLibraryCollection:
    """A collection of another class with Megatron-Core's behaviour: declared fields read
    None until set, ``hcp`` is a list of groups. A user who keeps Megatron's
    ``parallel_state`` passes such an object; mc adopts it by its attributes."""

    _FIELDS = frozenset({"tp", "pp", "dp", "dp_cp", "ep", "hcp", "tp_ep_pp_with_egtp_remat"})

    def __init__(self, **groups: Any) -> None:
        self.__dict__.update(groups)

    def __getattr__(self, name: str) -> None:
        if name in self._FIELDS:
            return
        raise AttributeError(name)


class _Key(NamedTuple):
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert_parallel: bool


def _foreign_layout(ddp: DistributedDataParallel, model: nn.Module) -> Any:
    """The layout ``ddp`` computed, moved onto ``model``'s params (a copy of the wrapped
    model: same order) and re-expressed in objects of other classes, with the fields of
    Megatron-Core's ``BufferKey`` / ``PerBufferParamLayout`` / ``FullParamLayout``."""
    same = dict(zip(ddp.module.parameters(), model.parameters(), strict=True))
    layouts = {}
    for b in ddp.buffers:
        fields = dict(vars(b.param_layout))
        fields["param_index_map"] = {same[p]: v for p, v in fields["param_index_map"].items()}
        layouts[_Key(b.param_dtype, b.grad_dtype, False)] = SimpleNamespace(**fields)
    return SimpleNamespace(layouts=layouts)


def _default_and_custom_groups() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    default = mg.initialize_model_parallel(set_default=True)
    dp, dp_cp, singles = _new_groups(world)
    world_group = dist.group.WORLD
    assert world_group is not None
    mg.barrier(world_group)  # every peer finished the new groups' handshakes
    try:
        custom = mg.ProcessGroupCollection(
            dp=dp, dp_cp=dp_cp, pp=singles[0][rank], tp=singles[1][rank], ep=singles[2][rank]
        )
        model1, reference = _TwoLayer(), _TwoLayer()
        model2 = copy.deepcopy(model1)
        cfg = ddp_config(overlap_grad_reduce=True, bucket_size=10000)
        ddp1 = DistributedDataParallel(mg.ModelParallelConfig(), cfg, model1)  # the default
        ddp2 = DistributedDataParallel(mg.ModelParallelConfig(), cfg, model2, pg_collection=custom)
        x = _batch(rank)
        out1, out2 = ddp1(x), ddp2(x)
        torch.autograd.backward(out1.sum())
        torch.autograd.backward(out2.sum())
        pairs = list(zip(model1.parameters(), model2.parameters(), strict=True))
        local_equal = all(torch.equal(p.main_grad, q.main_grad) for p, q in pairs)  # type: ignore[attr-defined]
        with mg.record_collectives() as log1:
            ddp1.finish_grad_sync()
        with mg.record_collectives() as log2:
            ddp2.finish_grad_sync()
        reduced_equal = all(torch.equal(p.main_grad, q.main_grad) for p, q in pairs)  # type: ignore[attr-defined]
        # the same wrap from another library's collection and layout objects
        model3 = copy.deepcopy(model1)
        foreign = _OtherLibraryCollection(
            dp=dp, dp_cp=dp_cp, pp=singles[0][rank], tp=singles[1][rank], hcp=[dp]
        )
        ddp3 = DistributedDataParallel(
            mg.ModelParallelConfig(),
            cfg,
            model3,
            pg_collection=foreign,  # type: ignore[arg-type]
            full_param_layout=_foreign_layout(ddp2, model3),
        )
        torch.autograd.backward(ddp3(x).sum())
        with mg.record_collectives() as log3:
            ddp3.finish_grad_sync()
        pairs3 = zip(model2.parameters(), model3.parameters(), strict=True)
        foreign_equal = all(torch.equal(p.main_grad, q.main_grad) for p, q in pairs3)  # type: ignore[attr-defined]
        # reference: the mean over ranks of each rank's grad of its own sum-loss
        grads = []
        for r in range(world):
            reference.zero_grad()
            torch.autograd.backward(reference(_batch(r)).sum())
            grads.append([p.grad.detach().clone() for p in reference.parameters()])  # type: ignore[union-attr]
        mean = [torch.stack(gs).mean(0) for gs in zip(*grads, strict=True)]
        error = max(
            float((p.main_grad - g).abs().max())  # type: ignore[attr-defined]
            for p, g in zip(model2.parameters(), mean, strict=True)
        )
        return {
            "outputs_equal": torch.equal(out1, out2),
            "local_equal": local_equal,
            "reduced_equal": reduced_equal,
            "foreign_equal": foreign_equal,
            "foreign_groups": [r.group_ranks for r in log3],
            # Megatron's field: None without a given layout and without the distributed
            # optimizer; the given one (mc's copy, keyed by mc's BufferKey) otherwise
            "layout_none": ddp1.full_param_layout is None,
            "layout_kept": ddp3.full_param_layout is not None
            and list(ddp3.full_param_layout.layouts)
            == [BufferKey(torch.float32, torch.float32, False)]
            and ddp3.full_param_layout.layouts[BufferKey(torch.float32, torch.float32, False)]
            == ddp3.buffers[0].param_layout
            and ddp3.buffers[0].bucket_indices == ddp2.buffers[0].bucket_indices,
            "error": error,
            "groups": ([r.group_ranks for r in log1], [r.group_ranks for r in log2]),
        }
    finally:
        mg.barrier(world_group)
        for group in [dp, dp_cp] + [singles[i][rank] for i in range(3)]:
            dist.destroy_process_group(group)
        clear_default_collection()
        mg.destroy_model_parallel(default)


def test_ddp_with_dp_process_groups(rank_pools: RankPools) -> None:
    """Follows ``tests/unit_tests/distributed/test_distributed_data_parallel.py::
    TestDistributedDataParallel::test_ddp_with_dp_process_groups``.

    Same facts (dp = world = 2, ``overlap_grad_reduce`` with ``bucket_size=10000``): a DDP
    over the default groups and one over a collection holding only dp, dp_cp, pp, tp and ep
    give identical outputs and identical ``main_grad`` after the backward (exact). Added: both
    stay identical after ``finish_grad_sync``, each reduced over its own 2-rank group, and
    equal the mean of the two ranks' grads computed in one process.
    """
    for out in rank_pools.get(2).run(_default_and_custom_groups):
        assert out["outputs_equal"]
        assert out["local_equal"]
        assert out["reduced_equal"]
        assert out["error"] <= 1e-6
        assert out["groups"] == ([(0, 1)], [(0, 1)])
        # mc adopts another library's collection and layout by their attributes (issue 20):
        # same reduced grads, same one all-reduce over the 2-rank dp_cp group
        assert out["foreign_equal"]
        assert out["foreign_groups"] == [(0, 1)]
        assert out["layout_none"]
        assert out["layout_kept"]
