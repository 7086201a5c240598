"""Conformance with Megatron-LM's
``tests/unit_tests/distributed/test_grad_sync_with_expert_parallel.py``: the same facts held
against mc-ddp on 4 gloo ranks.

Upstream builds expert layers (native / Transformer Engine / grouped GEMM MoE layers); what
DDP sees of them is params marked ``allreduce=False``, which is what the models here carry.
Which layer implementation produced the mark is mc-tp-layers' business (tested there), so the
three ``implementation`` variants collapse into one. Values are powers of two or binary
fractions, compared exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
from mc_ddp import DistributedDataParallel
from mc_ddp_tests._harness import ddp_config, model_parallel
from mc_ddp_tests.test_conformance_test_param_and_grad_buffer import (
    expected_value,
    grad_sync_trace,
)
from mc_groups.testing import RankPools

# (tp, etp, gtp_remat, expert gtp_remat): upstream's three topologies where expert and dense
# data-parallel groups differ.
TOPOLOGIES = [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 1, 2)]
# (ep, etp, optimizer instances) on 4 ranks; (2, 2, 2) would need 2 instances of a 1-rank
# expert data-parallel group.
GRID = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]


def _expert_linear() -> nn.Linear:
    """An expert layer's weight as DDP sees it: bf16, ``allreduce=False``."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 16, bias=False).to(torch.bfloat16)
    layer.weight.allreduce = False  # type: ignore[attr-defined]
    return layer


def _expert_group_case(tp: int, etp: int, gtp: int, egtp: int) -> dict[str, Any]:
    with model_parallel(
        tensor_model_parallel_size=tp,
        expert_tensor_parallel_size=etp,
        gtp_remat_size=gtp,
        expert_gtp_remat_size=egtp,
    ) as pgc:
        assert pgc.expt_dp is not None
        assert pgc.dp_cp is not None
        module = _expert_linear()
        per_token = mg.ModelParallelConfig(calculate_per_token_loss=True)
        ddp = DistributedDataParallel(
            per_token,
            ddp_config(grad_reduce_in_fp32=True),
            module,
            pg_collection=pgc,
        )
        for param in module.parameters():
            param.main_grad.fill_(float(2 ** dist.get_rank()))  # type: ignore[attr-defined]
        with mg.record_collectives() as log:
            ddp.finish_grad_sync()
        return {
            "values": sorted(
                {float(v) for p in module.parameters() for v in p.main_grad.view(-1)}  # type: ignore[attr-defined]
            ),
            "expt_dp": mg.group_ranks(pgc.expt_dp),
            "dp_cp": mg.group_ranks(pgc.dp_cp),
            "buffers": (len(ddp.buffers), len(ddp.expert_parallel_buffers)),
            "allreduce": [getattr(p, "allreduce", True) for p in module.parameters()],
            "ops": [(r.op, r.reduce_op, r.group_ranks) for r in log],
        }


class _MoE(nn.Module):
    """Dense and expert layers interleaved (a router and its experts, per layer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router0 = nn.Linear(8, 8)
        self.expert0 = nn.Linear(8, 8)
        self.router1 = nn.Linear(8, 8)
        self.expert1 = nn.Linear(8, 8)
        for layer in (self.expert0, self.expert1):
            for param in layer.parameters():
                param.allreduce = False  # type: ignore[attr-defined]
        self.to(torch.bfloat16)


def _grad_sync_case(ep: int, etp: int, instances: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with model_parallel(
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        num_distributed_optimizer_instances=instances,
    ) as pgc:
        assert pgc.expt_dp is not None
        out["expt_dp"] = mg.group_size(pgc.expt_dp)
        for dist_opt in (False, True):
            if instances > 1 and not dist_opt:
                continue
            for overlap in (False, True):
                for average in (False, True):
                    cfg = ddp_config(
                        grad_reduce_in_fp32=True,
                        use_distributed_optimizer=dist_opt,
                        overlap_grad_reduce=overlap,
                        average_in_collective=average,
                        num_distributed_optimizer_instances=instances,
                    )
                    ddp = DistributedDataParallel(
                        mg.ModelParallelConfig(), cfg, _MoE(), pg_collection=pgc
                    )
                    (dense,) = ddp.buffers
                    (expert,) = ddp.expert_parallel_buffers

                    def fill(dense: Any = dense, expert: Any = expert) -> None:
                        # an expert sees the tokens of ep·etp data-parallel batches
                        dense.grad_data.fill_(1.0)
                        expert.grad_data.fill_(float(ep * etp))

                    key = str((dist_opt, overlap, average))
                    out[key] = grad_sync_trace(ddp, fill, overlap)
    return out


def _four_rank_facts() -> dict[str, Any]:
    return {
        "groups": {str(t): _expert_group_case(*t) for t in TOPOLOGIES},
        "grad_sync": {str(g): _grad_sync_case(*g) for g in GRID},
    }


@pytest.fixture(scope="module")
def four_ranks(rank_pools: RankPools) -> list[dict[str, Any]]:
    return rank_pools.get(4).run(_four_rank_facts)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_expert_grad_sync_uses_expert_data_parallel_group(
    four_ranks: list[dict[str, Any]], topology: tuple[int, int, int, int]
) -> None:
    """Follows ``tests/unit_tests/distributed/test_grad_sync_with_expert_parallel.py::
    test_expert_grad_sync_uses_expert_data_parallel_group``.

    Same topologies (tp 2 / etp 1, tp 1 / etp 2, expert gtp_remat 2), same facts: the expert
    data-parallel group (without the gtp_remat axis) differs from the dense one; with a
    per-token loss (no pre-scaling) and grad ``2**rank`` on every rank, every expert grad ends
    as the sum of ``2**r`` over the expert data-parallel ranks (powers of two make each rank
    set's sum distinct, so the wrong group would show); DDP holds no dense buffer and one
    expert buffer; every param has ``allreduce=False``. The recorder also shows the single
    SUM all-reduce on that group.
    """
    for rank, out in enumerate(four_ranks):
        facts = out["groups"][str(topology)]
        expt_dp, dp_cp = facts["expt_dp"], facts["dp_cp"]
        assert rank in expt_dp
        assert expt_dp != dp_cp
        expected = float(sum(2**r for r in expt_dp))
        assert expected != float(sum(2**r for r in dp_cp))
        assert facts["values"] == [expected]
        assert facts["buffers"] == (0, 1)
        assert facts["allreduce"] == [False]
        assert facts["ops"] == [("all_reduce", "sum", expt_dp)]


@pytest.mark.parametrize("grid", GRID)
def test_grad_sync(four_ranks: list[dict[str, Any]], grid: tuple[int, int, int]) -> None:
    """Follows ``tests/unit_tests/distributed/test_grad_sync_with_expert_parallel.py::
    test_grad_sync``.

    Same grid (ep, etp ∈ {1, 2} × 1 or 2 optimizer instances × distributed optimizer × overlap ×
    average_in_collective; on 4 ranks, so ep = etp = 2 with 2 instances is left out), one bucket per
    buffer. Dense grads start at 1, expert grads at ep·etp (an expert sees that many data-parallel
    batches). Facts: every param is in exactly one group; each group (dense, expert) dispatches and
    may finish only once its own last param is ready, its ``grad_data[0]`` unchanged before;
    afterwards it is 1 for both, except on a distributed-optimizer rank not owning element 0 under
    SUM, where it keeps the pre-scaled value (1/dp dense, ep·etp/dp = 1/|expt_dp| expert); the
    scaling uses the whole dp (4), the shard index counts inside the optimizer instance. Readings as
    in ``test_conformance_test_param_and_grad_buffer.py::test_grad_sync`` (mc's non-overlap finish
    is idempotent within an iteration; early finishes are refused with several instances too).
    """
    ep, etp, instances = grid
    dp = 4
    for out in four_ranks:
        facts = out["grad_sync"][str(grid)]
        edp = facts["expt_dp"]
        assert edp == dp // (ep * etp)
        for dist_opt in (False, True):
            if instances > 1 and not dist_opt:
                continue
            for overlap in (False, True):
                for average in (False, True):
                    trace = facts[str((dist_opt, overlap, average))]
                    assert [s["kind"] for s in trace] == ["dense", "dense", "expert", "expert"] * 2
                    for step in trace:
                        assert step["owners"] == 1  # every param in exactly one group
                        start = 1.0 if step["kind"] == "dense" else float(ep * etp)
                        if overlap and step["index"] < step["size"] - 1:
                            assert (step["refused"], step["value"], step["ops"]) == (
                                True,
                                start,
                                [],
                            )
                            continue
                        assert not step["refused"]
                        if step["kind"] == "dense":
                            scale = 1.0 if average else 1.0 / dp
                        else:
                            scale = edp / dp if average else 1.0 / dp
                        want = expected_value(
                            start=start,
                            dist_opt=dist_opt,
                            shard_rank=step["shard"][0],
                            scale=scale,
                        )
                        assert step["value"] == want, (grid, dist_opt, overlap, average, step)
                        # the reduction ran once the group was complete (an expert group of
                        # one rank, ep = etp = 2, has nothing to communicate)
                        alone = step["kind"] == "expert" and edp == 1
                        assert bool(step["ops"]) is not alone, step
