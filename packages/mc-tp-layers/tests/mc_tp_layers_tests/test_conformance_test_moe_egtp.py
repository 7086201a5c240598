"""Conformance with Megatron-LM's ``tests/unit_tests/generalized_tensor_parallel/test_moe_egtp.py``.

mc has no MoE layer (router, token dispatcher, grouped experts), so upstream's loss
trajectory of a whole MoE layer (EP = 4 against EP = 2 × expert gtp_remat = 2, MXFP8) is
not covered. Its layer-level facts are held with mc's expert linears: with EP = 2 and
expert gtp_remat = 2 on 4 ranks (dense gtp_remat off), an expert layer's weight is sharded
along dim 0 over the expert gtp_remat group, and the sharded layer computes what the full
weight computes. The router's expert-bias update is mc-finalize's; only the group it
reduces over (``tp_dp_cp``) is a fact of the layout checked here.

Difference noted: Megatron takes an expert layer's shard count from the
``expt_gtp_remat`` group it resolves; mc reads ``config.gtp_remat_size`` for dense and
expert layers alike (and checks it against the group), so an expert-only gtp_remat run
gives its expert layers a config with ``gtp_remat_size`` = the expert gtp_remat size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers_tests._helpers import assert_close, backward, config, randn, world

LAYOUT = {"expert_model_parallel_size": 2, "expert_gtp_remat_size": 2}


def _copy_of(full: torch.Tensor) -> Callable[[torch.Tensor], object]:
    return lambda master: master.copy_(full)


def _expert_shards(d: dict[str, torch.Tensor]) -> dict[str, Any]:
    pgc = world(1, **LAYOUT)
    try:
        expert_cfg = config(1, gtp_remat_size=2, expert_model_parallel_size=2)
        expert = tpl.ColumnParallelLinear(
            8,
            6,
            config=expert_cfg,
            init_method=_copy_of(d["w"]),
            bias=False,
            is_expert=True,
            pg_collection=pgc,
        )
        dense = tpl.ColumnParallelLinear(
            8,
            6,
            config=config(1, expert_model_parallel_size=2),
            init_method=_copy_of(d["w"]),
            bias=False,
            pg_collection=pgc,
        )
        assert expert.weight is not None
        assert dense.weight is not None
        x = d["x"].clone().requires_grad_()
        with mg.record_collectives() as log:
            y, _ = expert(x)
            backward(y, d["dy"])
        return {
            "egtp": mg.group_ranks(pgc.require("expt_gtp_remat", "test")),
            "group_is_egtp": getattr(expert.weight, "group", None) is pgc.expt_gtp_remat,
            "shard": expert.weight.detach(),
            "allreduce": getattr(expert.weight, "allreduce", None),
            "dense_shape": tuple(dense.weight.shape),
            "dense_tagged": hasattr(dense.weight, "is_gtp_weight_remat"),
            "y": y.detach(),
            "dx": x.grad,
            "dw": expert.weight.grad,
            "ops": [(e.op, e.group_ranks) for e in log],
        }
    finally:
        mg.destroy_model_parallel(pgc)


def test_moe_egtp_expert_weights_shard_over_expert_gtp_remat(rank_pools: RankPools) -> None:
    """Follows ``tests/unit_tests/generalized_tensor_parallel/test_moe_egtp.py::
    TestMoEEGTPCorrectness::test_moe_egtp_loss_trajectory_matches_baseline`` (its layer facts).

    EP = 2 × expert gtp_remat = 2 on 4 ranks: the expert gtp_remat groups are {0, 2} and
    {1, 3}; an expert column layer's ``[6, 8]`` weight becomes the ``[3, 8]`` shard of
    rows ``[3g, 3g + 3)`` over that group (``allreduce`` False: an expert-parallel weight),
    while a dense layer (gtp_remat off) stays whole. With the same input on the peers the
    output and dX equal the full weight's and the shard's gradient is its rows of the full
    wgrad (the mean of identical peers; upstream's comment reads it as ``egtp_remat_size ·
    dW`` and divides by it in its step: the SUM reading, see
    ``test_conformance_test_gtp_loss_correctness.py``). Only the expert gtp_remat group
    communicates (no TP: expert TP = 1).
    """
    d = {"x": randn(5, 8, seed=1), "w": randn(6, 8, seed=2), "dy": randn(5, 6, seed=3)}
    x, w = d["x"].clone().requires_grad_(), d["w"].clone().requires_grad_()
    y = x @ w.t()
    backward(y, d["dy"])
    assert w.grad is not None
    for r, res in enumerate(rank_pools.get(4).run(_expert_shards, d)):
        egtp, g = (r % 2, r % 2 + 2), r // 2
        assert res["egtp"] == egtp
        assert res["group_is_egtp"]
        assert torch.equal(res["shard"], d["w"][3 * g : 3 * g + 3])
        assert res["allreduce"] is False
        assert (res["dense_shape"], res["dense_tagged"]) == ((6, 8), False)
        assert_close(res["y"], y, "expert output")
        assert_close(res["dx"], x.grad, "expert dX")  # type: ignore[arg-type]
        assert_close(res["dw"], w.grad[3 * g : 3 * g + 3], "expert shard grad")
        assert res["ops"] == [
            ("all_gather", egtp),
            ("all_gather", egtp),
            ("reduce_scatter", egtp),
        ]


def _tp_dp_cp() -> dict[str, int]:
    pgc = world(1, gtp_remat_size=2)
    try:
        return {
            name: pgc.require(name, "test").size() for name in ("tp_dp_cp", "dp_cp", "gtp_remat")
        }
    finally:
        mg.destroy_model_parallel(pgc)


def test_expert_bias_gtp_inclusive(rank_pools: RankPools) -> None:
    """Follows ``tests/unit_tests/generalized_tensor_parallel/test_moe_egtp.py::
    TestMoEEGTPCorrectness::test_expert_bias_gtp_inclusive`` (its group fact).

    gtp_remat peers hold distinct tokens but share the replicated router, so the group the
    expert-bias token counts are summed over, ``tp_dp_cp``, must span the gtp_remat axis
    like data parallelism: at TP = 1, gtp_remat = 2, DP = 2 on 4 ranks its size is
    ``|dp_cp| · |gtp_remat|`` = 4 (Megatron-Core's ``get_tensor_and_data_parallel_group``,
    built from ``'tp-gtp_remat-dp-cp'``). mc builds it over ``tp-dp-cp`` (size 2), so an
    expert-bias update over it would let gtp_remat peers' biases drift apart.
    """
    for res in rank_pools.get(4).run(_tp_dp_cp):
        assert res["tp_dp_cp"] == res["dp_cp"] * res["gtp_remat"] == 4
