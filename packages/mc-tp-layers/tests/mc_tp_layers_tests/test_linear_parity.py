"""Column- and RowParallelLinear against one ``nn.Linear`` holding the full weight.

Each rank loads its slice of a full weight and bias, runs forward and backward on its part
of a shared input and output gradient, and returns what it computed. The test assembles
the shards and compares them with a single-process ``nn.Linear`` (outputs, input grads,
weight and bias grads) for TP = 1, 2 and 4, sequence parallelism off and on. Tolerance:
1e-5 relative to each tensor's scale (see ``_helpers``): TP only reorders fp32 sums.
The collective schedule of each case is checked from the recorder.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers_tests._helpers import assert_close, chunk, config, ops, randn, world

S, B, K, N = 4, 2, 8, 16  # sequence, batch, in features, out features


def _data() -> dict[str, torch.Tensor]:
    return {
        "x": randn(S, B, K, seed=1),
        "w": randn(N, K, seed=2),
        "b": randn(N, seed=3),
        "dy": randn(S, B, N, seed=4),
        "xr": randn(S, B, N, seed=5),  # row layer input (features N -> K)
        "wr": randn(K, N, seed=6),
        "br": randn(K, seed=7),
        "dyr": randn(S, B, K, seed=8),
    }


def _reference(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy: torch.Tensor
) -> dict[str, torch.Tensor]:
    linear = torch.nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(b)
    xx = x.clone().requires_grad_()
    y = linear(xx)
    y.backward(dy)
    assert xx.grad is not None
    assert linear.weight.grad is not None
    assert linear.bias.grad is not None
    return {"y": y.detach(), "dx": xx.grad, "dw": linear.weight.grad, "db": linear.bias.grad}


def _run_column(
    pgc: mg.ProcessGroupCollection, d: dict[str, torch.Tensor], sp: bool, gather: bool
) -> dict[str, Any]:
    g = pgc.require("tp", "test")
    r, w = g.rank(), g.size()
    layer = tpl.ColumnParallelLinear(
        K,
        N,
        config=config(w, sequence_parallel=sp),
        init_method=torch.nn.init.zeros_,
        gather_output=gather,
        pg_collection=pgc,
    )
    assert layer.weight is not None
    assert layer.bias is not None
    with torch.no_grad():
        layer.weight.copy_(chunk(d["w"], w, r, 0))
        layer.bias.copy_(chunk(d["b"], w, r, 0))
    x = (chunk(d["x"], w, r, 0) if sp else d["x"].clone()).requires_grad_()
    with mg.record_collectives() as fwd:
        y, bias = layer(x)
    dy = d["dy"] if gather else chunk(d["dy"], w, r, -1)
    with mg.record_collectives() as bwd:
        y.backward(dy)
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dw": layer.weight.grad,
        "db": layer.bias.grad,
        "fwd": ops(fwd),
        "bwd": ops(bwd),
        "bwd_async": [e.async_op for e in bwd],
        "bias": bias,
    }


def _run_row(
    pgc: mg.ProcessGroupCollection, d: dict[str, torch.Tensor], sp: bool, parallel_input: bool
) -> dict[str, Any]:
    g = pgc.require("tp", "test")
    r, w = g.rank(), g.size()
    layer = tpl.RowParallelLinear(
        N,
        K,
        config=config(w, sequence_parallel=sp),
        init_method=torch.nn.init.zeros_,
        bias=True,
        input_is_parallel=parallel_input,
        skip_bias_add=False,
        pg_collection=pgc,
    )
    assert layer.bias is not None
    with torch.no_grad():
        layer.weight.copy_(chunk(d["wr"], w, r, 1))
        layer.bias.copy_(d["br"])
    x = (chunk(d["xr"], w, r, -1) if parallel_input else d["xr"].clone()).requires_grad_()
    with mg.record_collectives() as fwd:
        y, bias = layer(x)
    dy = chunk(d["dyr"], w, r, 0) if sp else d["dyr"]
    with mg.record_collectives() as bwd:
        y.backward(dy)
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dw": layer.weight.grad,
        "db": layer.bias.grad,
        "fwd": ops(fwd),
        "bwd": ops(bwd),
        "bias": bias,
    }


def _all_cases(d: dict[str, torch.Tensor]) -> dict[str, Any]:
    w = mg.group_size(torch.distributed.group.WORLD)  # type: ignore[arg-type]
    pgc = world(w)
    try:
        sps = [False, True] if w > 1 else [False]
        out: dict[str, Any] = {}
        for sp in sps:
            out[f"col sp={sp}"] = _run_column(pgc, d, sp, gather=False)
            out[f"row sp={sp}"] = _run_row(pgc, d, sp, parallel_input=True)
        out["col gather"] = _run_column(pgc, d, False, gather=True)
        out["row split input"] = _run_row(pgc, d, False, parallel_input=False)
        return out
    finally:
        mg.destroy_model_parallel(pgc)


def _check_column(
    results: list[dict[str, Any]], ref: dict[str, torch.Tensor], sp: bool, gather: bool
) -> None:
    w = len(results)
    y = torch.cat([res["y"] for res in results], dim=-1) if not gather else results[0]["y"]
    assert_close(y, ref["y"], "column output")
    if gather:
        for res in results:
            assert_close(res["y"], ref["y"], "gathered output on every rank")
    if sp:
        assert_close(torch.cat([res["dx"] for res in results], dim=0), ref["dx"], "column dX rows")
    else:
        for res in results:
            assert_close(res["dx"], ref["dx"], "column dX (all-reduced)")
    assert_close(torch.cat([res["dw"] for res in results], dim=0), ref["dw"], "column dW rows")
    assert_close(torch.cat([res["db"] for res in results], dim=0), ref["db"], "column db")
    for res in results:
        assert res["bias"] is None
        if w == 1:
            assert res["fwd"] == []
            assert res["bwd"] == []
        elif sp:
            assert res["fwd"] == ["all_gather"]
            assert res["bwd"] == ["all_gather", "reduce_scatter"]
            assert all(res["bwd_async"])
        else:
            assert res["fwd"] == (["all_gather"] if gather else [])
            assert res["bwd"] == ["all_reduce"]
            assert res["bwd_async"] == [True]


def _check_row(
    results: list[dict[str, Any]], ref: dict[str, torch.Tensor], sp: bool, parallel_input: bool
) -> None:
    w = len(results)
    if sp:
        assert_close(torch.cat([res["y"] for res in results], dim=0), ref["y"], "row output rows")
    else:
        for res in results:
            assert_close(res["y"], ref["y"], "row output (all-reduced)")
    if parallel_input:
        assert_close(torch.cat([res["dx"] for res in results], dim=-1), ref["dx"], "row dX cols")
    else:
        for res in results:
            assert_close(res["dx"], ref["dx"], "row dX (gathered)")
    assert_close(torch.cat([res["dw"] for res in results], dim=1), ref["dw"], "row dW cols")
    # Under SP each rank's bias grad covers its own rows: their sum is the full grad
    db = sum(res["db"] for res in results) if sp else results[0]["db"]
    assert_close(db, ref["db"], "row db")
    for res in results:
        assert res["bias"] is None
        if w == 1:
            assert res["fwd"] == []
            assert res["bwd"] == []
        elif sp:
            assert res["fwd"] == ["reduce_scatter"]
            assert res["bwd"] == ["all_gather"]
        else:
            assert res["fwd"] == ["all_reduce"]
            assert res["bwd"] == ([] if parallel_input else ["all_gather"])


@pytest.mark.parametrize("w", [1, 2, 4])
def test_column_and_row_match_nn_linear(rank_pools: RankPools, w: int) -> None:
    d = _data()
    ref_col = _reference(d["x"], d["w"], d["b"], d["dy"])
    ref_row = _reference(d["xr"], d["wr"], d["br"], d["dyr"])
    per_rank = rank_pools.get(w).run(_all_cases, d)
    for sp in [False, True] if w > 1 else [False]:
        _check_column([res[f"col sp={sp}"] for res in per_rank], ref_col, sp, gather=False)
        _check_row([res[f"row sp={sp}"] for res in per_rank], ref_row, sp, parallel_input=True)
    _check_column([res["col gather"] for res in per_rank], ref_col, False, gather=True)
    _check_row([res["row split input"] for res in per_rank], ref_row, False, parallel_input=False)
