"""The layers' steady-state forward (a call signature the last checked forward passed skips
the checks, reading the weight and bias from ``Module._parameters``) sees every change a
checked forward would: on 2 gloo ranks, ``ColumnParallelLinear(8 → 6)`` and
``RowParallelLinear(6 → 8)`` run twice (the second forward is the steady one), then:

- a new bias Parameter, a new weight Parameter, and a parametrization (the weight becomes
  a property of a new class, no longer in ``_parameters``) each change the output exactly
  as the full-matrix reference ``x · Wᵀ + b`` computed here in one process says;
- a wrong input width raises the checked path's ``ValueError`` after steady forwards too;
- the collectives recorded are the same for the checked and the steady forward.

The row layer's steady forward applies its linear and the output reduction as one autograd
node (``mc_tp_layers._reduced_linear``): with sequence parallelism off and on and with
``gradient_accumulation_fusion``, three forward + backward calls give bitwise the checked
call's output, dX, dW (or main_grad) and db, and its collectives, and match the one-process
``x · Wᵀ + b`` and its gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.utils import parametrize

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools, error_kind

from ._helpers import (
    assert_close,
    backward,
    chunk,
    config,
    grad,
    main_grad,
    randn,
    row_parallel,
    world,
)


class _Double(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def _init(w: torch.Tensor) -> None:
    torch.nn.init.normal_(w, generator=torch.Generator().manual_seed(3))


def _run() -> dict[str, Any]:
    pgc = world(2)
    assert pgc.tp is not None
    rank = mg.group_rank(pgc.tp)
    cfg = config(2)
    col = tpl.ColumnParallelLinear(
        8, 6, config=cfg, init_method=_init, bias=True, pg_collection=pgc
    )
    row = row_parallel(6, 8, cfg, _init, pg_collection=pgc)
    x = randn(3, 2, 8, seed=1)
    h = chunk(randn(3, 2, 6, seed=2), 2, rank, dim=-1)
    out: dict[str, Any] = {}
    with torch.no_grad():
        logs = []
        for _ in range(2):  # the first forward checks, the second is steady
            with mg.record_collectives() as log:
                out.setdefault("col", []).append(col(x)[0].clone())
                out.setdefault("row", []).append(row(h)[0].clone())
            logs.append([(r.op, r.numel, r.label) for r in log])
        out["logs"] = logs
        out["steady"] = [col._steady is not None, row._steady is not None]  # the fast path ran
        assert col.weight is not None
        out["col w"], out["row w"] = col.weight.clone(), row.weight.clone()
        col.bias = torch.nn.Parameter(torch.full((3,), 10.0 + rank))
        row.bias = torch.nn.Parameter(torch.full((8,), -4.0))
        out["col new bias"], out["row new bias"] = col(x)[0].clone(), row(h)[0].clone()
        row.weight = torch.nn.Parameter(3 * row.weight.detach().clone())
        out["row new weight"] = row(h)[0].clone()
        row(h)  # steady again with the new weight
        parametrize.register_parametrization(row, "weight", _Double())
        out["row parametrized"] = row(h)[0].clone()
        out["row parametrized again"] = row(h)[0].clone()
    try:
        row(torch.ones(3, 2, 5))
        out["bad width"] = "no error"
    except Exception as err:
        out["bad width"] = f"{error_kind(err)}: {err}"
    return out


def test_steady_forward_sees_new_params_parametrizations_and_bad_input(
    rank_pools: RankPools,
) -> None:
    results = rank_pools.get(2).run(_run)
    x, h_full = randn(3, 2, 8, seed=1), randn(3, 2, 6, seed=2)
    col_w = torch.cat([r["col w"] for r in results])  # [6, 8]: rank r holds rows 3r..3r+2
    row_w = torch.cat([r["row w"] for r in results], dim=1)  # [8, 6]: rank r holds columns
    for rank, res in enumerate(results):
        first, steady = res["col"]
        assert torch.equal(first, steady)
        assert torch.equal(res["row"][0], res["row"][1])
        assert res["steady"] == [True, True]
        assert res["logs"][0] == res["logs"][1], res["logs"]
        assert res["logs"][1] == [("all_reduce", 48, "tp all-reduce")]
        mine = slice(3 * rank, 3 * rank + 3)
        assert_close(res["col new bias"], x @ col_w[mine].T + 10.0 + rank, "column new bias")
        assert_close(res["row new bias"], h_full @ row_w.T - 4.0, "row new bias")
        assert_close(res["row new weight"], h_full @ (3 * row_w).T - 4.0, "row new weight")
        for key in ("row parametrized", "row parametrized again"):
            assert_close(res[key], h_full @ (6 * row_w).T - 4.0, key)
        assert res["bad width"].startswith("ValueError"), res["bad width"]


def _graph_names(y: torch.Tensor) -> set[str]:
    """The names of every autograd node behind ``y``."""
    names, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None:
            names.add(type(node).__name__)
            todo.extend(fn for fn, _ in node.next_functions)
    return names


def _row_backward(sp: bool, fusion: bool) -> dict[str, Any]:
    pgc = world(2)
    assert pgc.tp is not None
    rank = mg.group_rank(pgc.tp)
    row = row_parallel(6, 8, config(2, sequence_parallel=sp), _init, pg_collection=pgc)
    if fusion:
        row.gradient_accumulation_fusion = True
        row.weight.main_grad = torch.zeros_like(row.weight)  # type: ignore[attr-defined]
    x = chunk(randn(4, 2, 6, seed=2), 2, rank, dim=-1).requires_grad_()
    dy = randn(4, 2, 8, seed=5)
    if sp:
        dy = chunk(dy, 2, rank, dim=0)
    out: dict[str, Any] = {"w": row.weight.detach().clone(), "calls": []}
    for _ in range(3):  # the first forward checks, the others are steady
        x.grad, row.weight.grad = None, None
        assert row.bias is not None
        row.bias.grad = None
        with mg.record_collectives() as log:
            y = row(x)[0]
            names = _graph_names(y)
            backward(y, dy)
        out["calls"].append(
            {
                "y": y.detach(),
                "dx": grad(x),
                "dw": None if fusion else grad(row.weight),
                "db": grad(row.bias),
                "log": [(r.op, r.numel, r.label) for r in log],
                "fused": "_LinearThenReduceBackward" in names,
            }
        )
    out["main_grad"] = main_grad(row.weight).clone() if fusion else None
    return out


@pytest.mark.parametrize(("sp", "fusion"), [(False, False), (True, False), (False, True)])
def test_steady_row_forward_is_one_node_with_the_checked_values_and_schedule(
    rank_pools: RankPools, sp: bool, fusion: bool
) -> None:
    """The row layer's steady forward applies the linear and the output reduction as one
    autograd node; output, dX, dW (or main_grad), db and the recorded collectives are
    those of the checked forward (bitwise) and of ``x · Wᵀ + b`` in one process."""
    results = rank_pools.get(2).run(_row_backward, sp, fusion)
    x = randn(4, 2, 6, seed=2)
    w = torch.cat([r["w"] for r in results], dim=1)  # [8, 6]: rank r holds columns 3r..3r+2
    dy = randn(4, 2, 8, seed=5)
    y_ref, dx_ref = x @ w.T, dy @ w
    dw_ref = dy.reshape(-1, 8).T @ x.reshape(-1, 6)
    for rank, res in enumerate(results):
        mine, rows = (
            slice(3 * rank, 3 * rank + 3),
            slice(2 * rank, 2 * rank + 2) if sp else slice(None),
        )
        first, *steady = res["calls"]
        assert [first["fused"], *(c["fused"] for c in steady)] == [False, True, True]
        for call in steady:
            for key in ("y", "dx", "dw", "db"):
                assert (first[key] is None and call[key] is None) or torch.equal(
                    first[key], call[key]
                ), key
            assert call["log"] == first["log"], (first["log"], call["log"])
        assert_close(first["y"], y_ref[rows], "y")
        assert_close(first["dx"], dx_ref[..., mine], "dX")
        assert_close(first["db"], dy[rows].sum(dim=(0, 1)), "db")
        if fusion:
            assert_close(res["main_grad"], 3 * dw_ref[:, mine], "main_grad after 3 calls")
        else:
            assert_close(first["dw"], dw_ref[:, mine], "dW")
        expected = (
            [
                ("reduce_scatter", 4 * 2 * 8, "tp reduce-scatter dim 0"),
                ("all_gather", 4 * 2 * 8 // 2, "tp gather dim 0"),  # this rank's part,
            ]
            if sp
            else [("all_reduce", 4 * 2 * 8, "tp all-reduce")]
        )
        assert first["log"] == expected, first["log"]
