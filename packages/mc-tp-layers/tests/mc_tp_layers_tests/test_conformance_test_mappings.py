"""Conformance with Megatron-LM's ``tests/unit_tests/tensor_parallel/test_mappings.py``.

Upstream runs every mapping on 8 ranks split into two tensor-parallel groups of 4
(``initialize_model_parallel(4, 2)``) and never names a group: each mapping falls back to
the global TP group, so ranks 0-3 and 4-7 reduce and gather among themselves (a sum of
ranks is 6 in the first group and 22 in the second). Here 4 ranks form two TP groups of 2
(TP = 2, DP = 2) registered as the default collection, and every mapping is called without
``group``: the same facts with sums 0 + 1 = 1 and 2 + 3 = 5.

Upstream checks backward by calling each autograd Function's ``backward`` with a hand-made
``ctx``; here backward runs through autograd on the mapping's output (the same function).
The direct calls (``backward`` with a bare ``ctx``, and each Function's ``symbolic``) are
held by ``test_mapping_functions.py::test_functions_called_directly``.

Values are small integers: every result is exact in fp32 and compared with ``torch.equal``.
Every collective is recorded with its group, which must be this rank's TP group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import mc_groups as mg
from mc_groups.testing import RankPools
from mc_tp_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from mc_tp_layers_tests._helpers import backward, world

_Mapping = Callable[[torch.Tensor], torch.Tensor]


def _through(fn: _Mapping, x: torch.Tensor, grad: torch.Tensor) -> dict[str, Any]:
    """Forward and backward of ``fn`` with the collectives each issued (op, group ranks)."""
    x = x.clone().requires_grad_()
    with mg.record_collectives() as fwd:
        y = fn(x)
    with mg.record_collectives() as bwd:
        backward(y, grad)
    return {
        "y": y.detach(),
        "dx": x.grad,
        "fwd": [(e.op, e.group_ranks) for e in fwd],
        "bwd": [(e.op, e.group_ranks) for e in bwd],
    }


def _rows(values: Sequence[float], width: int) -> torch.Tensor:
    """A ``[len(values), width]`` fp32 tensor whose row j is ``values[j]``."""
    column = torch.tensor([float(v) for v in values]).unsqueeze(1)
    return column.expand(-1, width).contiguous()


def _mappings_with_default_group() -> dict[str, Any]:
    pgc = world(2, set_default=True)
    try:
        r = torch.distributed.get_rank()
        one = torch.ones(1) * r
        table = torch.arange(32.0).reshape(8, 4)
        gp = gather_from_sequence_parallel_region
        return {
            "members": mg.group_ranks(pgc.require("tp", "test")),
            "copy": _through(copy_to_tensor_model_parallel_region, one, one),
            "reduce": _through(reduce_from_tensor_model_parallel_region, one, one),
            "scatter": _through(
                scatter_to_tensor_model_parallel_region, table, torch.ones(8, 2) * r
            ),
            "gather": _through(
                gather_from_tensor_model_parallel_region, torch.ones(8, 2) * r, table
            ),
            "scatter_sp": _through(
                scatter_to_sequence_parallel_region, table, torch.ones(4, 4) * r
            ),
            "gather_sp": _through(
                lambda t: gp(t, tensor_parallel_output_grad=True),
                torch.ones(1, 4) * r,
                _rows([0.0, 1.0], 4),
            ),
            "reduce_scatter_sp": _through(
                reduce_scatter_to_sequence_parallel_region,
                _rows([0.0, 1.0], 4),
                torch.ones(1, 4) * r,
            ),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.fixture(scope="module")
def results(rank_pools: RankPools) -> list[dict[str, Any]]:
    """Per rank of a 4-rank world (TP = 2, DP = 2, default collection): every mapping."""
    out = rank_pools.get(4).run(_mappings_with_default_group)
    for r, res in enumerate(out):
        # The layout: TP is the fastest axis, so the TP groups are {0, 1} and {2, 3}.
        assert res["members"] == ((0, 1) if r < 2 else (2, 3))
    return out


def _mates(r: int) -> tuple[int, int]:
    """The global ranks of rank r's TP group."""
    return (0, 1) if r < 2 else (2, 3)


def _tp_rank(r: int) -> int:
    return r % 2


def test_copy_to_model_parallel_region(results: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_mappings.py::test_CopyToModelParallelRegion``.

    Forward is the identity; backward sums the gradient over the TP group only (1 in the
    first group, 5 in the second), with one all-reduce on that group.
    """  # noqa: E501
    for r, res in enumerate(results):
        out = res["copy"]
        assert torch.equal(out["y"], torch.ones(1) * r)
        assert torch.equal(out["dx"], torch.ones(1) * sum(_mates(r)))
        assert out["fwd"] == []
        assert out["bwd"] == [("all_reduce", _mates(r))]


def test_reduce_from_model_parallel_region(results: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_mappings.py::test_ReduceFromModelParallelRegion``.

    Forward sums over the TP group (1 / 5); backward is the identity (the gradient comes
    back unchanged, nothing is communicated).
    """  # noqa: E501
    for r, res in enumerate(results):
        out = res["reduce"]
        assert torch.equal(out["y"], torch.ones(1) * sum(_mates(r)))
        assert torch.equal(out["dx"], torch.ones(1) * r)
        assert out["fwd"] == [("all_reduce", _mates(r))]
        assert out["bwd"] == []


def test_scatter_to_model_parallel_region(results: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_mappings.py::test_ScatterToModelParallelRegion``.

    Forward keeps column chunk ``tp_rank`` of the last dimension (no communication);
    backward concatenates the TP group's gradients along the last dimension in rank order
    (upstream: a 1-D gradient, whose only dimension is the last).
    """  # noqa: E501
    table = torch.arange(32.0).reshape(8, 4)
    for r, res in enumerate(results):
        out = res["scatter"]
        t = _tp_rank(r)
        assert torch.equal(out["y"], table[:, 2 * t : 2 * t + 2])
        first, second = _mates(r)
        assert torch.equal(out["dx"], _rows([first, first, second, second], 8).t())
        assert out["fwd"] == []
        assert out["bwd"] == [("all_gather", _mates(r))]


def test_gather_from_model_parallel_region(results: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_mappings.py::test_GatherFromModelParallelRegion``.

    Forward concatenates the TP group's chunks along the last dimension in rank order (the
    second group gets its own ranks, upstream's ``+ 4``); backward keeps column chunk
    ``tp_rank`` of the gradient.
    """  # noqa: E501
    table = torch.arange(32.0).reshape(8, 4)
    for r, res in enumerate(results):
        out = res["gather"]
        first, second = _mates(r)
        assert torch.equal(out["y"], _rows([first, first, second, second], 8).t())
        t = _tp_rank(r)
        assert torch.equal(out["dx"], table[:, 2 * t : 2 * t + 2])
        assert out["fwd"] == [("all_gather", _mates(r))]
        assert out["bwd"] == []


def test_scatter_to_sequence_parallel_region(results: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_mappings.py::test_ScatterToSequenceParallelRegion``.

    Forward keeps rows ``[4·tp_rank, 4·tp_rank + 4)`` of dim 0 (no communication); backward
    all-gathers the gradient along dim 0 in rank order. Reading: upstream checks the
    backward through ``_ScatterToModelParallelRegion.backward`` (the last-dim mapping) on a
    1-D tensor, where the last dim is dim 0; here the sequence-parallel mapping's own
    backward is checked, which gives the same concatenation.
    """  # noqa: E501
    table = torch.arange(32.0).reshape(8, 4)
    for r, res in enumerate(results):
        out = res["scatter_sp"]
        t = _tp_rank(r)
        assert torch.equal(out["y"], table[4 * t : 4 * t + 4])
        first, second = _mates(r)
        assert torch.equal(out["dx"], _rows([first] * 4 + [second] * 4, 4))
        assert out["fwd"] == []
        assert out["bwd"] == [("all_gather", _mates(r))]


def test_gather_from_sequence_parallel_region(results: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_mappings.py::test_GatherFromSequenceParallelRegion``.

    Forward concatenates the TP group's rows along dim 0; with
    ``tensor_parallel_output_grad=True`` backward reduce-scatters: the gradient rows are
    ``j`` for row j on every rank, so rank t keeps ``TP · t`` (upstream ``4 · (rank % 4)``).
    """  # noqa: E501
    for r, res in enumerate(results):
        out = res["gather_sp"]
        assert torch.equal(out["y"], _rows(_mates(r), 4))
        assert torch.equal(out["dx"], torch.ones(1, 4) * 2 * _tp_rank(r))
        assert out["fwd"] == [("all_gather", _mates(r))]
        assert out["bwd"] == [("reduce_scatter", _mates(r))]


def test_reduce_scatter_to_sequence_parallel_region(results: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_mappings.py::test_ReduceScatterToSequenceParallelRegion``.

    Forward sums over the TP group and keeps this rank's rows of dim 0 (row t of a tensor
    whose row j is ``j`` on every rank: ``TP · t``); backward all-gathers along dim 0.
    """  # noqa: E501
    for r, res in enumerate(results):
        out = res["reduce_scatter_sp"]
        assert torch.equal(out["y"], torch.ones(1, 4) * 2 * _tp_rank(r))
        assert torch.equal(out["dx"], _rows(_mates(r), 4))
        assert out["fwd"] == [("reduce_scatter", _mates(r))]
        assert out["bwd"] == [("all_gather", _mates(r))]
