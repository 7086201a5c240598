"""Mappings: forward and backward values on rank-valued inputs, and the collectives issued.

Inputs hold ``r + 1`` or ``arange`` values so every result is derivable by hand: over W
ranks ``Σ_r (r + 1) = W(W + 1)/2``. Values are small integers, so fp32 results are exact
and compared with ``==``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import mc_groups as mg
from mc_groups.collection import set_default_collection
from mc_groups.testing import RankPools, error_kind
from mc_tp_layers.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    all_to_all,
    all_to_all_hp2sp,
    all_to_all_sp2hp,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from mc_tp_layers_tests._helpers import ops, world


def _fwd_bwd(fn: Any, x: torch.Tensor, grad: torch.Tensor) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    with mg.record_collectives() as fwd:
        y = fn(x)
    with mg.record_collectives() as bwd:
        y.backward(grad)
    assert x.grad is not None
    return {"y": y.detach(), "dx": x.grad, "fwd": ops(fwd), "bwd": ops(bwd)}


def _tp_region_cases() -> dict[str, Any]:
    pgc = world(mg.group_size(torch.distributed.group.WORLD))  # type: ignore[arg-type]
    try:
        g = pgc.require("tp", "test")
        r, w = g.rank(), g.size()
        ones = torch.ones(2, 2)
        row = torch.arange(2.0 * w).expand(2, -1)
        return {
            "copy": _fwd_bwd(
                lambda t: copy_to_tensor_model_parallel_region(t, g), ones, (r + 1) * ones
            ),
            "reduce": _fwd_bwd(
                lambda t: reduce_from_tensor_model_parallel_region(t, g),
                (r + 1) * ones,
                (r + 1) * ones,
            ),
            "scatter": _fwd_bwd(
                lambda t: scatter_to_tensor_model_parallel_region(t, g), row, (r + 1) * ones
            ),
            "gather": _fwd_bwd(
                lambda t: gather_from_tensor_model_parallel_region(t, g),
                torch.full((2, 2), float(r)),
                row,
            ),
            "ag_last": _fwd_bwd(
                lambda t: all_gather_last_dim_from_tensor_parallel_region(t, g),
                torch.full((2, 2), float(r)),
                (r + 1) * row,
            ),
            "rs_last": _fwd_bwd(
                lambda t: reduce_scatter_last_dim_to_tensor_parallel_region(t, g),
                (r + 1) * row,
                torch.full((2, 2), float(r)),
            ),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("w", [2, 4])
def test_tensor_parallel_region(rank_pools: RankPools, w: int) -> None:
    total = w * (w + 1) / 2
    row = torch.arange(2.0 * w).expand(2, -1)
    by_rank = torch.arange(float(w)).repeat_interleave(2).expand(2, -1)  # [0,0,1,1,...]
    for r, out in enumerate(rank_pools.get(w).run(_tp_region_cases)):
        mine = slice(2 * r, 2 * r + 2)
        ones = torch.ones(2, 2)
        # f: identity forward, all-reduce backward
        assert torch.equal(out["copy"]["y"], ones)
        assert torch.equal(out["copy"]["dx"], total * ones)
        assert (out["copy"]["fwd"], out["copy"]["bwd"]) == ([], ["all_reduce"])
        # g: all-reduce forward, identity backward
        assert torch.equal(out["reduce"]["y"], total * ones)
        assert torch.equal(out["reduce"]["dx"], (r + 1) * ones)
        assert (out["reduce"]["fwd"], out["reduce"]["bwd"]) == (["all_reduce"], [])
        # scatter keeps chunk r; its backward gathers every rank's (rank + 1) chunk
        assert torch.equal(out["scatter"]["y"], row[:, mine])
        assert torch.equal(out["scatter"]["dx"], (by_rank + 1))
        assert (out["scatter"]["fwd"], out["scatter"]["bwd"]) == ([], ["all_gather"])
        # gather concatenates rank-valued chunks; backward keeps chunk r
        assert torch.equal(out["gather"]["y"], by_rank)
        assert torch.equal(out["gather"]["dx"], row[:, mine])
        assert (out["gather"]["fwd"], out["gather"]["bwd"]) == (["all_gather"], [])
        # last-dim all-gather: backward sums (rank + 1)·row over ranks, keeps chunk r
        assert torch.equal(out["ag_last"]["y"], by_rank)
        assert torch.equal(out["ag_last"]["dx"], total * row[:, mine])
        assert (out["ag_last"]["fwd"], out["ag_last"]["bwd"]) == (
            ["all_gather"],
            ["reduce_scatter"],
        )
        # last-dim reduce-scatter: the transpose of the above
        assert torch.equal(out["rs_last"]["y"], total * row[:, mine])
        assert torch.equal(out["rs_last"]["dx"], by_rank)
        assert (out["rs_last"]["fwd"], out["rs_last"]["bwd"]) == (
            ["reduce_scatter"],
            ["all_gather"],
        )


def _sequence_region_cases() -> dict[str, Any]:
    pgc = world(mg.group_size(torch.distributed.group.WORLD))  # type: ignore[arg-type]
    try:
        g = pgc.require("tp", "test")
        r, w = g.rank(), g.size()
        col = torch.arange(2.0 * w).unsqueeze(1)  # [2W, 1]
        mine = torch.full((2, 1), float(r))
        return {
            "scatter": _fwd_bwd(
                lambda t: scatter_to_sequence_parallel_region(t, g),
                col,
                (r + 1) * torch.ones(2, 1),
            ),
            "gather_rs": _fwd_bwd(
                lambda t: gather_from_sequence_parallel_region(t, True, g), mine, (r + 1) * col
            ),
            "gather_split": _fwd_bwd(
                lambda t: gather_from_sequence_parallel_region(t, False, g), mine, col
            ),
            "rs": _fwd_bwd(
                lambda t: reduce_scatter_to_sequence_parallel_region(t, g), (r + 1) * col, mine
            ),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("w", [2, 4])
def test_sequence_parallel_region(rank_pools: RankPools, w: int) -> None:
    total = w * (w + 1) / 2
    col = torch.arange(2.0 * w).unsqueeze(1)
    by_rank = torch.arange(float(w)).repeat_interleave(2).unsqueeze(1)
    for r, out in enumerate(rank_pools.get(w).run(_sequence_region_cases)):
        rows = slice(2 * r, 2 * r + 2)
        assert torch.equal(out["scatter"]["y"], col[rows])
        assert torch.equal(out["scatter"]["dx"], by_rank + 1)
        assert (out["scatter"]["fwd"], out["scatter"]["bwd"]) == ([], ["all_gather"])
        # gather with a TP-parallel consumer: backward reduce-scatters Σ (r+1)·col
        assert torch.equal(out["gather_rs"]["y"], by_rank)
        assert torch.equal(out["gather_rs"]["dx"], total * col[rows])
        assert out["gather_rs"]["bwd"] == ["reduce_scatter"]
        # gather with a replicated consumer: backward only keeps this rank's rows
        assert torch.equal(out["gather_split"]["dx"], col[rows])
        assert out["gather_split"]["bwd"] == []
        assert torch.equal(out["rs"]["y"], total * col[rows])
        assert torch.equal(out["rs"]["dx"], by_rank)
        assert (out["rs"]["fwd"], out["rs"]["bwd"]) == (["reduce_scatter"], ["all_gather"])


def _uneven_cases() -> dict[str, Any]:
    pgc = world(2)
    try:
        g = pgc.require("tp", "test")
        r = g.rank()
        sizes = [3, 1]
        mine = torch.full((sizes[r], 2), float(r + 1))
        full = torch.arange(8.0).reshape(4, 2)
        return {
            "gather": _fwd_bwd(
                lambda t: gather_from_sequence_parallel_region(
                    t, True, g, output_split_sizes=sizes
                ),
                mine,
                (r + 1) * full,
            ),
            "rs": _fwd_bwd(
                lambda t: reduce_scatter_to_sequence_parallel_region(t, g, input_split_sizes=sizes),
                (r + 1) * full,
                mine,
            ),
            "scatter": _fwd_bwd(
                lambda t: scatter_to_sequence_parallel_region(t, g, split_sizes=sizes),
                full,
                mine,
            ),
        }
    finally:
        mg.destroy_model_parallel(pgc)


def test_uneven_sequence_splits_are_padded(rank_pools: RankPools) -> None:
    # Rank 0 owns rows 0-2, rank 1 row 3. Rank-valued parts (r + 1) gather to [1,1,1,2].
    full = torch.arange(8.0).reshape(4, 2)
    gathered = torch.tensor([[1.0, 1.0]] * 3 + [[2.0, 2.0]])
    rows = [slice(0, 3), slice(3, 4)]
    for r, out in enumerate(rank_pools.get(2).run(_uneven_cases)):
        assert torch.equal(out["gather"]["y"], gathered)
        assert torch.equal(out["gather"]["dx"], 3 * full[rows[r]])  # Σ (r+1) = 3
        assert torch.equal(out["rs"]["y"], 3 * full[rows[r]])
        assert torch.equal(out["rs"]["dx"], gathered)
        assert torch.equal(out["scatter"]["y"], full[rows[r]])
        assert torch.equal(out["scatter"]["dx"], gathered)


def _all_to_all_cases() -> dict[str, Any]:
    pgc = world(mg.group_size(torch.distributed.group.WORLD))  # type: ignore[arg-type]
    try:
        g = pgc.require("tp", "test")
        r, w = g.rank(), g.size()
        # rank r sends row j = 10r + j to rank j
        x = torch.tensor([[10.0 * r + j] for j in range(w)])
        grad = torch.tensor([[100.0 * r + j] for j in range(w)])
        even = _fwd_bwd(lambda t: all_to_all(g, t), x, grad)
        # uneven on 2 ranks: rank 0 sends 1 row to 0 and 2 to 1; rank 1 sends 2 rows to 0, 1 to 1
        ins = [[1, 2], [2, 1]][r] if w == 2 else None
        outs = [[1, 2], [2, 1]][r] if w == 2 else None
        xu = torch.arange(3.0).unsqueeze(1) + 10 * r
        uneven = _fwd_bwd(lambda t: all_to_all(g, t, outs, ins), xu, xu + 100) if w == 2 else {}
        tokens = torch.arange(4.0 * w * 2 * w).reshape(4 * w, 2 * w)  # [tokens, H]
        sp = tokens.chunk(w, 0)[r].clone()
        hp = tokens.chunk(w, 1)[r].clone()
        return {
            "even": even,
            "uneven": uneven,
            "sp2hp": _fwd_bwd(lambda t: all_to_all_sp2hp(t, g), sp, hp),
            "hp2sp": _fwd_bwd(lambda t: all_to_all_hp2sp(t, g), hp, sp),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("w", [2, 4])
def test_all_to_all_family(rank_pools: RankPools, w: int) -> None:
    tokens = torch.arange(4.0 * w * 2 * w).reshape(4 * w, 2 * w)
    for r, out in enumerate(rank_pools.get(w).run(_all_to_all_cases)):
        assert out["even"]["y"].flatten().tolist() == [10.0 * src + r for src in range(w)]
        # backward returns to rank j what rank j held at position r: 100·j + r
        assert out["even"]["dx"].flatten().tolist() == [100.0 * j + r for j in range(w)]
        assert (out["even"]["fwd"], out["even"]["bwd"]) == (["all_to_all"], ["all_to_all"])
        # sp→hp turns sequence rows into hidden columns, hp→sp undoes it; each backward is
        # the other mapping, so the gradient of sp2hp at hp is sp and vice versa
        assert torch.equal(out["sp2hp"]["y"], tokens.chunk(w, 1)[r])
        assert torch.equal(out["sp2hp"]["dx"], tokens.chunk(w, 0)[r])
        assert torch.equal(out["hp2sp"]["y"], tokens.chunk(w, 0)[r])
        assert torch.equal(out["hp2sp"]["dx"], tokens.chunk(w, 1)[r])
    if w == 2:
        r0, r1 = rank_pools.get(2).run(_all_to_all_cases)
        # rank 0 gets its row 0 and rank 1's rows 0-1; rank 1 gets rank 0's rows 1-2 and its row 2
        assert r0["uneven"]["y"].flatten().tolist() == [0.0, 10.0, 11.0]
        assert r1["uneven"]["y"].flatten().tolist() == [1.0, 2.0, 12.0]
        # rank r's output gradient is [100, 101, 102] + 10r; each row travels back to the
        # row it came from: rank 0's y rows came from (r0 row 0, r1 row 0, r1 row 1) and
        # rank 1's from (r0 row 1, r0 row 2, r1 row 2)
        assert r0["uneven"]["dx"].flatten().tolist() == [100.0, 110.0, 111.0]
        assert r1["uneven"]["dx"].flatten().tolist() == [101.0, 102.0, 112.0]


def _single_rank_and_default() -> dict[str, Any]:
    pgc = world(1)  # tp groups of one rank inside a 2-rank world
    try:
        g = pgc.require("tp", "test")
        x = torch.arange(4.0).reshape(2, 2)
        fns: list[Callable[..., torch.Tensor]] = [
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
            scatter_to_tensor_model_parallel_region,
            gather_from_tensor_model_parallel_region,
            scatter_to_sequence_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
            all_gather_last_dim_from_tensor_parallel_region,
            reduce_scatter_last_dim_to_tensor_parallel_region,
            all_to_all_sp2hp,
            all_to_all_hp2sp,
        ]
        with mg.record_collectives() as log:
            same = [fn(x, group=g) is x for fn in fns] + [all_to_all(g, x) is x]
        errors = []
        try:
            copy_to_tensor_model_parallel_region(x)
        except ValueError as err:
            errors.append(str(err))
        set_default_collection(pgc)
        defaulted = reduce_from_tensor_model_parallel_region(x) is x
        return {"same": same, "log": len(log), "errors": errors, "defaulted": defaulted}
    finally:
        mg.destroy_model_parallel(pgc)


def test_single_rank_groups_bypass_and_default_collection(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_single_rank_and_default):
        assert all(out["same"])
        assert out["log"] == 0
        assert "no process group" in out["errors"][0]
        assert "set_default=True" in out["errors"][0]
        assert out["defaulted"]


def _bad_inputs() -> dict[str, str]:
    pgc = world(2)
    try:
        g = pgc.require("tp", "test")
        cases: dict[str, Callable[[], object]] = {
            "last": lambda: scatter_to_tensor_model_parallel_region(torch.ones(2, 3), g),
            "seq": lambda: reduce_scatter_to_sequence_parallel_region(torch.ones(3, 2), g),
            "sizes": lambda: gather_from_sequence_parallel_region(
                torch.ones(2, 2), True, g, [1, 1]
            ),
            "count": lambda: reduce_scatter_to_sequence_parallel_region(
                torch.ones(4, 2), g, [1, 2, 1]
            ),
            "type": lambda: copy_to_tensor_model_parallel_region([1.0], g),  # type: ignore[arg-type]
            "group": lambda: copy_to_tensor_model_parallel_region(torch.ones(2), "tp"),  # type: ignore[arg-type]
            "hp2sp": lambda: all_to_all_hp2sp(torch.ones(3, 2), g),
        }
        messages: dict[str, str] = {}
        with mg.record_collectives() as log:
            for name, call in cases.items():
                try:
                    call()
                    messages[name] = "no error"
                except (ValueError, TypeError) as err:
                    messages[name] = f"{error_kind(err)}: {err}"
        messages["log"] = str(len(log))
        return messages
    finally:
        mg.destroy_model_parallel(pgc)


def test_bad_inputs_fail_before_any_collective(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_bad_inputs):
        assert out["log"] == "0"
        assert "ValueError" in out["last"]
        assert "(2, 3)" in out["last"]
        assert "last dimension" in out["last"]
        assert "sequence length" in out["seq"]
        assert "pad it" in out["seq"]
        assert "output_split_sizes=[1, 1]" in out["sizes"]
        assert "shape (2, 2)" in out["sizes"]
        assert "input_split_sizes=[1, 2, 1]" in out["count"]
        assert "2 ranks" in out["count"]
        assert out["type"].startswith("TypeError")
        assert "input_" in out["type"]
        assert out["group"].startswith("TypeError")
        assert "tp_group='tp'" in out["group"]
        assert "token count" in out["hp2sp"]
