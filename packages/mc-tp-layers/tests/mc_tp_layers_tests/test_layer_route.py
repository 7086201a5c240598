"""Each layer's one route, on 2 gloo ranks, against ``x · Wᵀ + b`` computed here in one
process:

- every forward reads the layer's params as they are now: a new bias Parameter, a new
  weight Parameter and a parametrization (the weight becomes a property of a new class, no
  longer in ``_parameters``) each change the output as the reference says; a wrong input
  width raises ``ValueError`` after earlier forwards too; the first and a later forward
  record the same collectives;
- ``RowParallelLinear`` applies its linear and the output reduction as one autograd node
  on every forward, the first included (``_LinearThenReduceBackward``, no separate
  reduction node): with sequence parallelism off and on and with
  ``gradient_accumulation_fusion``, three forward + backward calls give the reference's
  output, dX, dW (or ``main_grad``) and db, each call bitwise the first's, with the
  collectives counted by hand (all-reduce of Y; or reduce-scatter of Y, all-gather of dY);
- Megatron's ``_forward_impl`` hook: a ``RowParallelLinear`` subclass overriding it (a
  scaled linear) returns the partial sums, which the layer reduces (Megatron's contract);
  a ``ColumnParallelLinear`` subclass's override gives the output; a frozen row weight
  takes the frozen-weight function, reduced the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils import parametrize

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools, error_kind
from mc_tp_layers.linear import linear_with_grad_accumulation_and_async_allreduce

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


class _ScaledRow(tpl.RowParallelLinear):
    """A Megatron-style override: the linear of the default hook, times 3."""

    def _forward_impl(
        self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return 3 * linear_with_grad_accumulation_and_async_allreduce(input, weight, *args, **kwargs)


class _ScaledColumn(tpl.ColumnParallelLinear):
    def _forward_impl(
        self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        return 3 * linear_with_grad_accumulation_and_async_allreduce(input, weight, *args, **kwargs)


def _init(w: torch.Tensor) -> None:
    torch.nn.init.normal_(w, generator=torch.Generator().manual_seed(3))


def _graph_names(y: torch.Tensor) -> set[str]:
    """The names of every autograd node behind ``y``."""
    names, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None:
            names.add(type(node).__name__)
            todo.extend(fn for fn, _ in node.next_functions)
    return names


def _params_and_hooks() -> dict[str, Any]:
    pgc = world(2)
    assert pgc.tp is not None
    rank = mg.group_rank(pgc.tp)
    cfg = config(2)
    col = tpl.ColumnParallelLinear(8, 6, config=cfg, init_method=_init, pg_collection=pgc)
    row = row_parallel(6, 8, cfg, _init, pg_collection=pgc)
    scaled_row = _ScaledRow(
        6, 8, config=cfg, init_method=_init, bias=True, input_is_parallel=True,
        skip_bias_add=False, pg_collection=pgc,
    )  # fmt: skip
    scaled_col = _ScaledColumn(8, 6, config=cfg, init_method=_init, pg_collection=pgc)
    frozen = row_parallel(6, 8, cfg, _init, pg_collection=pgc)
    frozen.weight.requires_grad_(False)
    x = randn(3, 2, 8, seed=1)
    h = chunk(randn(3, 2, 6, seed=2), 2, rank, dim=-1)
    out: dict[str, Any] = {}
    with torch.no_grad():
        logs = []
        for _ in range(2):  # the first forward and a later one: the same route
            with mg.record_collectives() as log:
                out.setdefault("col", []).append(col(x)[0].clone())
                out.setdefault("row", []).append(row(h)[0].clone())
            logs.append([(r.op, r.numel, r.label) for r in log])
        out["logs"] = logs
        assert col.weight is not None
        out["col w"], out["row w"] = col.weight.clone(), row.weight.clone()
        out["scaled row"], out["scaled col"] = scaled_row(h)[0], scaled_col(x)[0]
        out["frozen"] = frozen(h)[0]
        col.bias = torch.nn.Parameter(torch.full((3,), 10.0 + rank))
        row.bias = torch.nn.Parameter(torch.full((8,), -4.0))
        out["col new bias"], out["row new bias"] = col(x)[0].clone(), row(h)[0].clone()
        row.weight = torch.nn.Parameter(3 * row.weight.detach().clone())
        out["row new weight"] = row(h)[0].clone()
        parametrize.register_parametrization(row, "weight", _Double())
        out["row parametrized"] = row(h)[0].clone()
        out["row parametrized again"] = row(h)[0].clone()
    try:
        row(torch.ones(3, 2, 5))
        out["bad width"] = "no error"
    except Exception as err:
        out["bad width"] = f"{error_kind(err)}: {err}"
    mg.destroy_model_parallel(pgc)
    return out


def test_every_forward_reads_the_params_and_the_hook(rank_pools: RankPools) -> None:
    results = rank_pools.get(2).run(_params_and_hooks)
    x, h_full = randn(3, 2, 8, seed=1), randn(3, 2, 6, seed=2)
    col_w = torch.cat([r["col w"] for r in results])  # [6, 8]: rank r holds rows 3r..3r+2
    row_w = torch.cat([r["row w"] for r in results], dim=1)  # [8, 6]: rank r holds columns
    for rank, res in enumerate(results):
        mine = slice(3 * rank, 3 * rank + 3)
        assert torch.equal(res["col"][0], res["col"][1])
        assert torch.equal(res["row"][0], res["row"][1])
        assert res["logs"][0] == res["logs"][1] == [("all_reduce", 48, "tp all-reduce")]
        assert_close(res["col"][0], x @ col_w[mine].T, "column")  # zero bias
        assert_close(res["row"][0], h_full @ row_w.T, "row")
        assert_close(res["scaled row"], 3 * h_full @ row_w.T, "overridden row hook")
        assert_close(res["scaled col"], 3 * x @ col_w[mine].T, "overridden column hook")
        assert_close(res["frozen"], h_full @ row_w.T, "frozen row weight")
        assert_close(res["col new bias"], x @ col_w[mine].T + 10.0 + rank, "column new bias")
        assert_close(res["row new bias"], h_full @ row_w.T - 4.0, "row new bias")
        assert_close(res["row new weight"], h_full @ (3 * row_w).T - 4.0, "row new weight")
        for key in ("row parametrized", "row parametrized again"):
            assert_close(res[key], h_full @ (6 * row_w).T - 4.0, key)
        assert res["bad width"].startswith("ValueError"), res["bad width"]


def _row_backward(cases: list[tuple[bool, bool]]) -> list[dict[str, Any]]:
    outs = []
    pgc = world(2)  # one set of groups for every case
    assert pgc.tp is not None
    rank = mg.group_rank(pgc.tp)
    for sp, fusion in cases:
        row = row_parallel(6, 8, config(2, sequence_parallel=sp), _init, pg_collection=pgc)
        if fusion:
            row.gradient_accumulation_fusion = True
            row.weight.main_grad = torch.zeros_like(row.weight)  # type: ignore[attr-defined]
        x = chunk(randn(4, 2, 6, seed=2), 2, rank, dim=-1).requires_grad_()
        dy = randn(4, 2, 8, seed=5)
        if sp:
            dy = chunk(dy, 2, rank, dim=0)
        out: dict[str, Any] = {"w": row.weight.detach().clone(), "calls": []}
        for _ in range(3):
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
                    "nodes": sorted(n for n in names if "Region" in n or "Linear" in n),
                }
            )
        out["main_grad"] = main_grad(row.weight).clone() if fusion else None
        outs.append(out)
    mg.destroy_model_parallel(pgc)
    return outs


CASES = [(False, False), (True, False), (False, True)]  # (sequence_parallel, fusion)


def test_row_forward_is_one_node_with_the_reference_values_and_schedule(
    rank_pools: RankPools,
) -> None:
    """The row layer's linear and output reduction are one autograd node on every call;
    output, dX, dW (or main_grad), db match ``x · Wᵀ`` in one process, every call bitwise
    the first's; the collectives are counted by hand. The cases run in one world call."""
    per_rank = rank_pools.get(2).run(_row_backward, CASES)
    x = randn(4, 2, 6, seed=2)
    dy = randn(4, 2, 8, seed=5)
    for case, (sp, fusion) in enumerate(CASES):
        results = [outs[case] for outs in per_rank]
        w = torch.cat([r["w"] for r in results], dim=1)  # [8, 6]: rank r holds columns
        y_ref, dx_ref = x @ w.T, dy @ w
        dw_ref = dy.reshape(-1, 8).T @ x.reshape(-1, 6)
        for rank, res in enumerate(results):
            _check_row_case(res, rank, sp, fusion, (y_ref, dx_ref, dw_ref, dy))


def _check_row_case(
    res: dict[str, Any], rank: int, sp: bool, fusion: bool, refs: tuple[torch.Tensor, ...]
) -> None:
    y_ref, dx_ref, dw_ref, dy = refs
    what = f"sp={sp} fusion={fusion} rank {rank}"
    mine = slice(3 * rank, 3 * rank + 3)
    rows = slice(2 * rank, 2 * rank + 2) if sp else slice(None)
    first, *later = res["calls"]
    for call in res["calls"]:
        assert call["nodes"] == ["_LinearThenReduceBackward"], (what, call["nodes"])
    for call in later:
        for key in ("y", "dx", "dw", "db"):
            assert (first[key] is None and call[key] is None) or torch.equal(
                first[key], call[key]
            ), (what, key)
        assert call["log"] == first["log"], (what, first["log"], call["log"])
    assert_close(first["y"], y_ref[rows], f"{what}: y")
    assert_close(first["dx"], dx_ref[..., mine], f"{what}: dX")
    assert_close(first["db"], dy[rows].sum(dim=(0, 1)), f"{what}: db")
    if fusion:
        assert_close(res["main_grad"], 3 * dw_ref[:, mine], f"{what}: main_grad after 3 calls")
    else:
        assert_close(first["dw"], dw_ref[:, mine], f"{what}: dW")
    expected = (
        [
            ("reduce_scatter", 4 * 2 * 8, "tp reduce-scatter dim 0"),
            ("all_gather", 4 * 2 * 8 // 2, "tp gather dim 0"),  # this rank's part, gathered
        ]
        if sp
        else [("all_reduce", 4 * 2 * 8, "tp all-reduce")]
    )
    assert first["log"] == expected, (what, first["log"])
