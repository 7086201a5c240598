"""Conformance with Megatron-LM's ``tests/unit_tests/generalized_tensor_parallel/test_tp_gtp.py``:
tensor parallelism and gtp_remat together, TP = 2 × gtp_remat = 2 on 4 ranks.

Upstream builds TE linears over hand-made groups; here the groups come from
``initialize_model_parallel(tensor_model_parallel_size=2, gtp_remat_size=2)`` and the
layers are mc's Column/RowParallelLinear, CPU-initialised from one full weight so every
value is checked against a single-process computation (1e-5 relative, ``_helpers``).
Every rank feeds the same input; the gtp_remat peers therefore compute identical weight
gradients, and their mean is each one's.

Not covered: ``TestTPGTPLayerNormLinear`` (TE ``LayerNormLinear``, not offered) and the
numbers of ``TestTPGTPPaddingAlignment`` (TE's ``_gtp_pre_init`` with
``pad_for_alignment=32``; mc pads dim 0 to a multiple of the gtp_remat size only, see the
module notes of :mod:`mc_tp_layers.gtp`). Its fact that the padding is measured on the
per-TP slice is held here. End-to-end training at TP = 2 × gtp_remat = 2 is held by
``integration_tests/test_parity_gtp.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers_tests._helpers import (
    assert_close,
    backward,
    chunk,
    config,
    randn,
    row_parallel,
    world,
)

TOKENS = 5


def _copy_of(full: torch.Tensor) -> Callable[[torch.Tensor], object]:
    """An ``init_method`` filling the master weight with ``full``."""
    return lambda master: master.copy_(full)


def _run(
    layer: tpl.ColumnParallelLinear | tpl.RowParallelLinear, x: torch.Tensor, dy: torch.Tensor
) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    with mg.record_collectives() as fwd:
        y, _ = layer(x)
    with mg.record_collectives() as bwd:
        backward(y, dy)
    weight = layer.weight
    assert weight is not None
    return {
        "shard": weight.detach().clone(),
        "pad_length": getattr(weight, "pad_length", None),
        "y": y.detach(),
        "dx": x.grad,
        "dw": weight.grad,
        "fwd": [(e.op, e.group_ranks) for e in fwd],
        "bwd": [(e.op, e.group_ranks) for e in bwd],
    }


def _tp_gtp(d: dict[str, torch.Tensor]) -> dict[str, Any]:
    pgc = world(2, gtp_remat_size=2)
    try:
        tp = pgc.require("tp", "test")
        cfg = config(2, gtp_remat_size=2)
        out: dict[str, Any] = {
            "tp": mg.group_ranks(tp),
            "gtp": mg.group_ranks(pgc.require("gtp_remat", "test")),
        }
        t = tp.rank()
        for name, w in (("column", d["w"]), ("column_padded", d["w10"])):
            layer = tpl.ColumnParallelLinear(
                8, w.shape[0], config=cfg, init_method=_copy_of(w), bias=False, pg_collection=pgc
            )
            out[name] = _run(layer, d["x"], chunk(d["dy_" + name], 2, t, -1))
        row = row_parallel(8, 8, cfg, _copy_of(d["w"]), bias=False, pg_collection=pgc)
        out["row"] = _run(row, chunk(d["x"], 2, t, -1), d["dy_column"])
        return out
    finally:
        mg.destroy_model_parallel(pgc)


def _padded_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """``w`` with zero rows appended up to ``rows``."""
    return torch.cat([w, torch.zeros(rows - w.shape[0], w.shape[1])])


def test_tp_gtp(rank_pools: RankPools) -> None:
    """Follows ``tests/unit_tests/generalized_tensor_parallel/test_tp_gtp.py::
    TestTPGTPProcessGroups::test_group_sizes_and_ranks``, ``::TestTPGTPColumnParallelLinear::
    test_forward_backward_correctness``, ``::TestTPGTPRowParallelLinear::test_forward_backward``,
    ``::TestTPGTPRowParallelLinear::test_forward_correctness`` and
    ``::TestTPGTPPaddingAlignment::test_pre_init_pads_per_tp_slice`` (its per-TP fact).

    - Layout ``rank = gtp_rank · TP + tp_rank``: TP groups {0, 1}, {2, 3}; gtp_remat
      groups {0, 2}, {1, 3}.
    - Column, W ``[8, 8]``: each rank holds rows ``[2g, 2g + 2)`` of its TP rows
      ``[4t, 4t + 4)``; the output ``[5, 4]`` is ``x · W_tᵀ``; dX (all-reduced over TP)
      is the full ``dY · W``; the shard's gradient is its rows of ``dY_tᵀ · x``. Forward
      gathers the weight over gtp_remat; backward re-gathers it, all-reduces dX over TP
      and reduce-scatters dW over gtp_remat.
    - Row, W ``[8, 8]``: the shard is ``[out / G, in / TP] = [4, 4]``; the all-reduced
      output is the full ``x · Wᵀ`` on every rank; dX is ``dY · W[:, cols of t]``.
    - Padding on the per-TP slice: a column weight of 10 rows has 5 per TP rank, padded to
      6 and split into 3-row shards (``pad_length`` 1 on every rank; padding the full 10
      rows instead would give 5-row shards that the TP split then cuts unevenly).
    """
    d = {
        "x": randn(TOKENS, 8, seed=1),
        "w": randn(8, 8, seed=2),
        "w10": randn(10, 8, seed=3),
        "dy_column": randn(TOKENS, 8, seed=4),
        "dy_column_padded": randn(TOKENS, 10, seed=5),
    }
    x, w = d["x"], d["w"]
    for r, res in enumerate(rank_pools.get(4).run(_tp_gtp, d)):
        t, g = r % 2, r // 2
        tp_ranks, gtp_ranks = (2 * g, 2 * g + 1), (t, t + 2)
        assert (res["tp"], res["gtp"]) == (tp_ranks, gtp_ranks)
        for name, full, dy in (
            ("column", w, d["dy_column"]),
            ("column_padded", d["w10"], d["dy_column_padded"]),
        ):
            out, local = res[name], full.chunk(2, 0)[t]
            rows = -(-local.shape[0] // 2)
            assert out["pad_length"] == 2 * rows - local.shape[0]
            padded = _padded_rows(local, 2 * rows)
            assert torch.equal(out["shard"], padded[rows * g : rows * (g + 1)])
            assert_close(out["y"], x @ local.t(), f"{name} output")
            assert_close(out["dx"], dy @ full, f"{name} dX")
            dw = _padded_rows(chunk(dy, 2, t, -1).t() @ x, 2 * rows)
            assert_close(out["dw"], dw[rows * g : rows * (g + 1)], f"{name} shard grad")
            assert out["fwd"] == [("all_gather", gtp_ranks)]
            assert out["bwd"] == [
                ("all_gather", gtp_ranks),
                ("all_reduce", tp_ranks),
                ("reduce_scatter", gtp_ranks),
            ]
        row = res["row"]
        assert row["shard"].shape == (4, 4)
        assert torch.equal(row["shard"], w[4 * g : 4 * g + 4, 4 * t : 4 * t + 4])
        assert_close(row["y"], x @ w.t(), "row output")
        assert_close(row["dx"], d["dy_column"] @ w[:, 4 * t : 4 * t + 4], "row dX")
