"""Conformance with Megatron-LM's ``tests/unit_tests/generalized_tensor_parallel/test_gtp_custom_pgs.py``.

Upstream builds two TransformerBlocks with the same weights: one over the global groups,
one over a collection whose ``gtp_remat`` pairs the 4 ranks differently ([0, 2], [1, 3]
instead of [0, 1], [2, 3]). A layer that read the global group instead of the one it was
handed would all-gather the wrong peer's shard. Here the "global" groups are mc's
registered default collection and the block is a column + row MLP.

Not covered: the GatedDeltaProduct mixer (``test_gdp_projections_use_custom_gtp_group``,
not offered).
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.collection import clear_default_collection, set_default_collection
from mc_groups.testing import RankPools
from mc_tp_layers_tests._helpers import assert_close, backward, config, randn, row_parallel, world

STRIDED = ([0, 2], [1, 3])


def _copy_of(full: torch.Tensor) -> Callable[[torch.Tensor], object]:
    return lambda master: master.copy_(full)


def _mlp(pgc: mg.ProcessGroupCollection, d: dict[str, torch.Tensor]) -> dict[str, Any]:
    cfg = config(1, gtp_remat_size=2)
    col = tpl.ColumnParallelLinear(
        8, 6, config=cfg, init_method=_copy_of(d["w1"]), bias=False, pg_collection=pgc
    )
    row = row_parallel(6, 8, cfg, _copy_of(d["w2"]), bias=False, pg_collection=pgc)
    assert col.weight is not None
    x = d["x"].clone().requires_grad_()
    with mg.record_collectives() as log:
        h, _ = col(x)
        y, _ = row(h)
        backward(y, d["dy"])
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dw": [col.weight.grad, row.weight.grad],
        "groups": [getattr(col.weight, "group", None), getattr(row.weight, "group", None)],
        "gathers": {e.group_ranks for e in log if e.op in ("all_gather", "reduce_scatter")},
    }


def _seed_from_explicit_groups(
    default: mg.ProcessGroupCollection, strided: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """Seed from explicit groups with no default collection registered: gtp_remat over the
    adjacent pairs, expert gtp_remat over the strided ones; two draws from each stream."""
    explicit = mg.ProcessGroupCollection(
        tp=default.tp,
        ep=default.ep,
        expt_tp=default.expt_tp,
        gtp_remat=default.gtp_remat,
        expt_gtp_remat=strided,
    )
    clear_default_collection()
    try:
        tracker = tpl.model_parallel_cuda_manual_seed(
            42, pg_collection=explicit, device="cpu", set_default=False
        )
    finally:
        set_default_collection(default)
    draws = {}
    for name in tracker.get_states():
        with tracker.fork(name):
            draws[name] = torch.rand(2)
    return draws


def _custom_pgs(d: dict[str, torch.Tensor]) -> dict[str, Any]:
    default = world(1, gtp_remat_size=2, set_default=True)
    # Every rank creates every group of the other pairing, in the same order.
    created = [dist.new_group(pair, timeout=timedelta(seconds=20)) for pair in STRIDED]
    me = dist.get_rank()
    mine = next(g for g, pair in zip(created, STRIDED, strict=True) if me in pair)
    try:
        custom = mg.ProcessGroupCollection(tp=default.tp, gtp_remat=mine)
        out: dict[str, Any] = {"default": _mlp(default, d), "custom": _mlp(custom, d)}
        out["custom_group_is_used"] = all(g is mine for g in out["custom"].pop("groups"))
        del out["default"]["groups"]
        # A collection without gtp_remat while gtp_remat is on: a clear error, before any
        # collective, even though the registered default holds a gtp_remat group.
        partial = mg.ProcessGroupCollection(tp=default.tp)
        with mg.record_collectives() as log:
            try:
                tpl.ColumnParallelLinear(
                    8,
                    6,
                    config=config(1, gtp_remat_size=2),
                    init_method=torch.nn.init.zeros_,
                    pg_collection=partial,
                )
                out["partial"] = "no error"
            except ValueError as err:
                out["partial"] = str(err)
        out["partial_log"] = len(log)
        out["streams"] = _seed_from_explicit_groups(default, mine)
        return out
    finally:
        dist.barrier()
        dist.destroy_process_group(mine)
        mg.destroy_model_parallel(default)


def _data() -> dict[str, torch.Tensor]:
    return {
        "x": randn(5, 8, seed=1),
        "w1": randn(6, 8, seed=2),
        "w2": randn(8, 6, seed=3),
        "dy": randn(5, 8, seed=4),
    }


@pytest.fixture(scope="module")
def results(rank_pools: RankPools) -> list[dict[str, Any]]:
    """Per rank of 4: the MLP over the default and over the custom collection, and the
    partial collection's error."""
    return rank_pools.get(4).run(_custom_pgs, _data())


def test_custom_gtp_pg_collection_matches_default(results: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/generalized_tensor_parallel/test_gtp_custom_pgs.py::
    TestGTPCustomProcessGroups::test_custom_gtp_pg_collection_matches_mpu``.

    With the default collection pairing gtp_remat ranks [0, 1], [2, 3], a layer built from
    a collection pairing them [0, 2], [1, 3] shards over that group (its ``group``; every
    gather and reduce-scatter names it) and gives the same output and input gradient,
    bit for bit (upstream: forward within 1e-5, all-gathers move data only), as the layer
    over the default; each shard's gradient is its rows of the full gradient, by the rank
    in the group it was given. Same input on every rank, as upstream.
    """
    d = _data()
    w1, w2 = (d[k].clone().requires_grad_() for k in ("w1", "w2"))
    x = d["x"].clone().requires_grad_()
    y = (x @ w1.t()) @ w2.t()
    backward(y, d["dy"])
    assert w1.grad is not None
    assert w2.grad is not None
    for r, res in enumerate(results):
        assert res["custom_group_is_used"]
        assert torch.equal(res["custom"]["y"], res["default"]["y"])
        assert torch.equal(res["custom"]["dx"], res["default"]["dx"])
        assert_close(res["custom"]["y"], y, "output")
        assert_close(res["custom"]["dx"], x.grad, "dX")  # type: ignore[arg-type]
        pair = next(tuple(p) for p in STRIDED if r in p)
        assert res["custom"]["gathers"] == {pair}
        assert res["default"]["gathers"] == {(0, 1) if r < 2 else (2, 3)}
        for name, g in (("custom", r // 2), ("default", r % 2)):
            dw1, dw2 = res[name]["dw"]
            assert_close(dw1, w1.grad[3 * g : 3 * g + 3], f"{name} column shard grad")
            assert_close(dw2, w2.grad[4 * g : 4 * g + 4], f"{name} row shard grad")


def test_pg_collection_without_gtp_remat_is_refused(results: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/generalized_tensor_parallel/test_gtp_custom_pgs.py::
    TestGTPCustomProcessGroups::test_pg_collection_without_gtp_remat_falls_back_to_mpu``.

    Reading: upstream's point is that a collection omitting ``gtp_remat`` must not
    silently build an unsharded layer; Megatron fills the gap from its global groups. mc
    takes every group from the collection it is handed and never mixes in the default, so
    the layer is refused with an error naming ``pg_collection.gtp_remat``, before any
    collective, although the registered default has a gtp_remat group (a deliberate
    difference: explicit groups). Either way sharding is never silently off.
    """
    for res in results:
        assert "pg_collection.gtp_remat" in res["partial"]
        assert res["partial_log"] == 0


def test_custom_gtp_groups_seed_without_default(results: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/generalized_tensor_parallel/test_gtp_custom_pgs.py::
    TestGTPCustomProcessGroups::test_custom_gtp_groups_seed_without_mpu``.

    With no default collection registered, ``model_parallel_cuda_manual_seed`` seeded from
    an explicit collection (one-rank TP/EP/expert-TP groups, gtp_remat over [0, 1], [2, 3],
    expert gtp_remat over [0, 2], [1, 3]) has both gtp_remat streams (upstream asserts
    their names; Megatron's ``get_gtp_remat_rng_tracker_name`` has no mc counterpart, so
    the names are spelled out), seeded from the explicit groups' ranks: ``42 + 2718 +
    65536·(1 + gtp rank)`` and ``42 + 1024 + 32768 + 65536·(1 + expert gtp rank)``.
    """
    for r, res in enumerate(results):
        streams = res["streams"]
        assert sorted(streams) == [
            "data-parallel-rng",
            "egtp-remat-rng",
            "expert-parallel-rng",
            "gtp-remat-rng",
            "model-parallel-rng",
        ]
        seeds = {
            "gtp-remat-rng": 42 + 2718 + 65536 * (1 + r % 2),
            "egtp-remat-rng": 42 + 1024 + 32768 + 65536 * (1 + r // 2),
        }
        for name, seed in seeds.items():
            expected = torch.rand(2, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(streams[name], expected), name
